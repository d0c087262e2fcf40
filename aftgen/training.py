"""Training: AdamW with warmup and cosine decay, periodic held-out eval, atomic checkpoints, exact resume."""

from __future__ import annotations

import json
import math
import shlex
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from aftgen import data, distributed
from aftgen.checkpoint import WEIGHT_DTYPES, WEIGHTS, is_checkpoint, read_weights, save_checkpoint
from aftgen.corpus import CorpusOptions, prepare_corpus
from aftgen.corpus.sources import DEFAULT_GLOB
from aftgen.corpus.split import DEFAULT_HELD_OUT
from aftgen.device import DEVICES, DTYPES, Placement, compiled, resolve
from aftgen.distributed import World
from aftgen.errors import AftgenError
from aftgen.evaluate import evaluate_ids
from aftgen.files import atomic_write, prepare_folder
from aftgen.model import AFTLM, MIXERS, AFTConfig
from aftgen.tokenizer import Tokenizer

TRAINING_STATE, TRAINING_INFO, METRICS = "training_state.safetensors", "training.json", "metrics.jsonl"

# Model sizes. "small" is the default, sized to learn a 1 MB corpus well in minutes on 2 CPU cores.
PRESETS: dict[str, dict] = {
    "tiny": dict(n_layer=2, n_embd=32, n_head=2, window=8, context_length=32, batch_size=8),
    "small": dict(n_layer=4, n_embd=192, n_head=6, window=32, context_length=128, batch_size=16),
    # The shipped default model: 7.7M parameters, under 16 MB stored in fp16, about an hour on 2 CPU cores.
    "medium": dict(n_layer=6, n_embd=320, n_head=10, window=32, context_length=256, batch_size=16, dropout=0.3),
}
MODEL_FIELDS = ("n_layer", "n_embd", "n_head", "window", "context_length", "dropout", "decay", "mixer")


@dataclass
class TrainOptions:
    """Everything `aftgen train` can be told; None means "from the preset"."""

    corpus: Path | list[Path]  # text files and folders of them
    out: Path | None = None
    preset: str = "small"
    n_layer: int | None = None
    n_embd: int | None = None
    n_head: int | None = None
    window: int | None = None
    context_length: int | None = None
    batch_size: int | None = None
    dropout: float | None = None
    decay: bool | None = None
    mixer: str | None = None
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    warmup_steps: int = 100
    grad_clip: float = 1.0
    max_steps: int = 5000
    max_time: float | None = None
    eval_interval: int = 250
    eval_windows: int = 32
    keep_best: bool = False
    weights_dtype: str = "fp32"
    seed: int = 1337
    vocab_size: int = 1024
    tokenizer_type: str = "bpe"
    encoding: str = "utf-8"
    errors: str = "strict"
    glob: str = DEFAULT_GLOB
    held_out: int = DEFAULT_HELD_OUT
    skip_bad_files: bool = False
    resume: bool = False
    overwrite: bool = False
    device: str = "auto"
    dtype: str = "auto"
    compile: bool = False
    command: str = ""
    extra: dict = field(default_factory=dict)

    def resolved(self) -> dict:
        """The preset with explicit options laid over it."""
        if self.preset not in PRESETS:
            raise AftgenError(f"unknown preset '{self.preset}'; choose one of: {', '.join(PRESETS)}")
        settings = {"dropout": 0.0, "decay": True, "mixer": "aft_local", **PRESETS[self.preset]}
        for name in (*MODEL_FIELDS, "batch_size"):
            if getattr(self, name) is not None:
                settings[name] = getattr(self, name)
        return settings

    def sources(self) -> list[Path]:
        return [Path(self.corpus)] if isinstance(self.corpus, (str, Path)) else [Path(p) for p in self.corpus]

    def corpus_options(self) -> CorpusOptions:
        names = ("glob", "held_out", "skip_bad_files", "encoding", "errors", "vocab_size", "tokenizer_type")
        return CorpusOptions(**{name: getattr(self, name) for name in names})

    def check(self) -> None:
        """Refuse out-of-range values before any work is done."""
        for name in ("lr", "max_steps", "eval_interval", "eval_windows", "vocab_size"):
            if getattr(self, name) <= 0:
                raise AftgenError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.max_time is not None and self.max_time <= 0:
            raise AftgenError(f"--max-time must be positive, got {self.max_time}")
        for name in ("warmup_steps", "weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise AftgenError(f"--{name.replace('_', '-')} must not be negative, got {getattr(self, name)}")
        if self.device.split(":")[0] not in DEVICES:
            raise AftgenError(f"unknown --device '{self.device}'; choose one of: {', '.join(DEVICES)}")
        if self.dtype not in ("auto", *DTYPES):
            raise AftgenError(f"unknown --dtype '{self.dtype}'; choose one of: auto, {', '.join(DTYPES)}")
        if self.weights_dtype not in WEIGHT_DTYPES:
            raise AftgenError(
                f"unknown --weights-dtype '{self.weights_dtype}'; choose one of: {', '.join(WEIGHT_DTYPES)}"
            )
        self.corpus_options().check()
        settings = self.resolved()
        if settings["batch_size"] <= 0:
            raise AftgenError(f"--batch-size must be positive, got {settings['batch_size']}")
        if settings["mixer"] not in MIXERS:
            raise AftgenError(f"unknown --mixer '{settings['mixer']}'; choose one of: {', '.join(MIXERS)}")
        for name, flag in (
            ("n_layer", "--layers"),
            ("n_embd", "--width"),
            ("n_head", "--heads"),
            ("context_length", "--context-length"),
        ):
            if settings[name] <= 0:
                raise AftgenError(f"{flag} must be positive, got {settings[name]}")
        AFTConfig(vocab_size=self.vocab_size, **{k: settings[k] for k in MODEL_FIELDS})  # window <= context, ...


def parse_duration(text: str) -> float:
    """'90', '90s', '10m', '1.5h' -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    text = text.strip().lower()
    scale = units.get(text[-1:], None)
    number = text[:-1] if scale else text
    try:
        seconds = float(number) * (scale or 1)
    except ValueError:
        raise AftgenError(f"cannot read duration '{text}'; use seconds or a unit, e.g. 150, 90s, 10m, 1h") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise AftgenError(f"duration must be positive, got '{text}'")
    return seconds


def learning_rate(options: TrainOptions, step: int, progress: float) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr as progress goes 0 -> 1."""
    if step < options.warmup_steps:
        return options.lr * (step + 1) / options.warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return options.lr * (options.min_lr_ratio + (1 - options.min_lr_ratio) * cosine)


def make_optimizer(model: AFTLM, options: TrainOptions) -> torch.optim.AdamW:
    """AdamW; weight decay only on matrices (not biases, norms, position biases or decays)."""
    matrices = [p for name, p in model.named_parameters() if p.dim() >= 2 and not name.endswith(".w")]
    others = [p for name, p in model.named_parameters() if not (p.dim() >= 2 and not name.endswith(".w"))]
    groups = [
        {"params": matrices, "weight_decay": options.weight_decay},
        {"params": others, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=options.lr, betas=(0.9, 0.99))


class Reporter:
    """Progress on stderr: a rich progress bar on a terminal, plain log lines otherwise."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.live = sys.stderr.isatty() and not quiet
        self.progress = None
        if self.live:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("step {task.fields[step]:>6}"),
                BarColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self.task = self.progress.add_task("train", total=1.0, status="", step=0)

    def __enter__(self) -> Reporter:
        if self.progress:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress:
            self.progress.stop()

    def log(self, message: str) -> None:
        if self.quiet:
            return
        if self.progress:
            self.progress.console.print(message)
        else:
            print(message, file=sys.stderr, flush=True)

    def update(self, step: int, progress: float, status: str) -> None:
        if self.progress:
            self.progress.update(self.task, completed=min(progress, 1.0), status=status, step=step)


class _Interrupts:
    """First SIGINT/SIGTERM asks the loop to save and stop; a second one stops at once."""

    def __init__(self) -> None:
        self.requested: str | None = None

    def __enter__(self) -> _Interrupts:
        self.previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in self.previous:
            signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name


def _held_out_loss(model: AFTLM, ids: torch.Tensor, length: int, windows: int) -> float:
    """Mean nats per token over evenly spaced fixed windows of the held-out ids (quick, deterministic)."""
    count = max(1, min(windows, (len(ids) - 1) // length))
    stride = max(1, (len(ids) - length - 1) // count)
    rows = torch.stack([ids[i * stride : i * stride + length + 1] for i in range(count)]).long()
    rows = rows.to(model.embed.weight.device)
    was_training = model.training
    model.eval()
    total = 0.0
    with torch.inference_mode():
        for group in rows.split(32):  # bounded memory however many windows are asked for
            logits = model(group[:, :-1])
            total += float(F.cross_entropy(logits.flatten(0, 1), group[:, 1:].flatten(), reduction="sum"))
    model.train(was_training)
    return total / (count * length)


def _save_training_state(out: Path, model: AFTLM, optimizer, generator: torch.Generator, info: dict) -> None:
    """Model, optimiser moments and RNG states in one safetensors file (one atomic write, no pickle)."""
    opt = optimizer.state_dict()
    tensors = {f"model.{k}": v.detach().float().contiguous() for k, v in model.state_dict().items()}
    for index, slots in opt["state"].items():
        for key, value in slots.items():
            tensors[f"optimizer.{index}.{key}"] = torch.as_tensor(value).float().contiguous()
    tensors["rng.torch"] = torch.get_rng_state()
    tensors["rng.data"] = generator.get_state()
    groups = [
        {k: v for k, v in group.items() if k != "params"} | {"params": group["params"]} for group in opt["param_groups"]
    ]
    metadata = {"info": json.dumps(info), "param_groups": json.dumps(groups)}
    atomic_write(out / TRAINING_STATE, save_safetensors(tensors, metadata=metadata))


def _bad_training_state(path: Path, exc: Exception) -> AftgenError:
    return AftgenError(f"{path}: cannot read training state ({str(exc)[:200]}); start again with --overwrite")


def _read_training_info(out: Path) -> tuple[dict, list]:
    """The run's info (settings, step, ...) and the optimiser's param groups, from the state file's header.

    The state file alone describes the run, so a kill between writing it and training.json loses nothing.
    """
    path = out / TRAINING_STATE
    try:
        with safe_open(str(path), "pt") as handle:
            metadata = handle.metadata()
        return json.loads(metadata["info"]), json.loads(metadata["param_groups"])
    except (OSError, SafetensorError, ValueError, KeyError, TypeError) as exc:
        raise _bad_training_state(path, exc) from None


def _load_training_state(out: Path, model: AFTLM, optimizer, generator: torch.Generator) -> dict:
    path = out / TRAINING_STATE
    info, groups = _read_training_info(out)
    try:
        tensors = load_safetensors(path.read_bytes())
        model.load_state_dict({k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")})
        state: dict[int, dict] = {}
        for name, value in tensors.items():
            if name.startswith("optimizer."):
                _, index, key = name.split(".", 2)
                state.setdefault(int(index), {})[key] = value
        for group in groups:
            group["betas"] = tuple(group["betas"])
        optimizer.load_state_dict({"state": state, "param_groups": groups})
        torch.set_rng_state(tensors["rng.torch"])
        generator.set_state(tensors["rng.data"])
    except (OSError, SafetensorError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise _bad_training_state(path, exc) from None
    return info


def _write_metrics(out: Path, rows: list[dict]) -> None:
    atomic_write(out / METRICS, "".join(json.dumps(row) + "\n" for row in rows))


def _read_metrics(out: Path) -> list[dict]:
    path = out / METRICS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def model_card(config: AFTConfig, info: dict, metrics: list[dict], sample: str = "") -> str:
    """A Hub-style README.md for a run."""
    last = metrics[-1] if metrics else {}
    final = info.get("final_eval") or {}
    lines = [
        "---",
        "library_name: aftgen",
        "license: mit",
        "tags: [aftgen, attention-free-transformer, text-generation]",
        "---",
        f"# {info.get('name', 'aftgen model')}",
        "",
        "A causal AFT-local language model (Attention Free Transformer, Zhai et al. 2021) trained with",
        "aftgen. It generates through a recurrent decoder whose memory and per-token cost stay constant",
        "however long the context grows.",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {info.get('parameters', '?'):,} |"
        if isinstance(info.get("parameters"), int)
        else "| parameters | ? |",
        f"| layers / width / heads | {config.n_layer} / {config.n_embd} / {config.n_head} |",
        f"| mixer / window / training length | {config.mixer} / {config.window} / {config.context_length} tokens |",
        f"| vocabulary | {config.vocab_size} ({info.get('tokenizer_type', '?')}) |",
        f"| steps / wall time | {info.get('step', '?')} / {info.get('elapsed', 0):.0f} s |",
    ]
    best = info.get("best")
    if best and info.get("options", {}).get("keep_best"):
        lines.append(f"| weights kept | step {best['step']}: the best held-out check during training |")
    if final:
        lines.append(
            f"| held-out ({info.get('held_out', {}).get('summary', 'last 10%')}) | "
            f"{final['nats_per_char']:.4f} nats/char, {final['bits_per_char']:.4f} bits/char |"
        )
    elif last:
        lines.append(f"| held-out (quick eval) | {last['held_out_nats_per_char']:.4f} nats/char |")
    lines += ["", "Trained with:", "", "```", info.get("command", "aftgen train ..."), "```", ""]
    lines += ["Use it:", "", "```", 'aftgen sample --model PATH_OR_HUB_ID --prompt "..."', "```", ""]
    if sample:
        lines += ["A sample:", "", "```", sample, "```", ""]
    return "\n".join(lines)


def run_card(out: Path, config: AFTConfig, sample: str = "") -> str:
    """The model card of the run in `out`, from its training.json and metrics.jsonl (either may be absent)."""
    try:
        info = json.loads((out / TRAINING_INFO).read_text()) if (out / TRAINING_INFO).exists() else {}
        metrics = _read_metrics(out)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AftgenError(f"{out}: cannot read {TRAINING_INFO} or {METRICS} ({exc})") from None
    if not isinstance(info, dict) or not all(isinstance(row, dict) for row in metrics):
        raise AftgenError(f"{out}: {TRAINING_INFO} or {METRICS} does not hold JSON objects")
    return model_card(config, info, metrics, sample)


def train(options: TrainOptions, quiet: bool = False, on_eval: Callable[[dict], None] | None = None) -> Path:
    """Train a tokenizer and a model on options.corpus; returns the run folder.

    Started by torchrun, each process runs this and they train one model together (see distributed.py).
    """
    options.check()
    placement = resolve(options.device, options.dtype, distributed.local_rank())
    with distributed.join(placement.device) as world:
        try:
            return _train(options, placement, world, quiet, on_eval)
        except Exception as exc:
            if world.distributed and distributed.lost_peer(exc):
                raise AftgenError(
                    f"process {world.rank}: lost contact with the other training processes ({type(exc).__name__}); "
                    "the last checkpoint is kept: fix the failed process and run again with --resume"
                ) from None
            raise


def _train(
    options: TrainOptions, placement: Placement, world: World, quiet: bool, on_eval: Callable[[dict], None] | None
) -> Path:
    sources = options.sources()
    corpus = shlex.join(map(str, sources))
    out = Path(options.out) if options.out else Path("runs") / sources[0].stem
    settings = options.resolved()
    holds_run = (out / TRAINING_INFO).exists() or (out / TRAINING_STATE).exists() or is_checkpoint(out)
    if not options.resume and not options.overwrite and holds_run:
        raise AftgenError(
            f"{out} already holds a run (or a checkpoint); pass --resume to continue it or --overwrite to replace it"
        )
    if options.resume and not (out / TRAINING_STATE).exists():
        raise AftgenError(f"{out} has no training state to resume; drop --resume to start a new run")
    if options.resume:
        saved, _ = _read_training_info(out)
        settings = saved["settings"]
    if world.main:
        prepare_folder(out)

    # Rank 0 trains the tokenizer (a resumed run keeps its own); one process per machine writes the token files.
    prepared = prepare_corpus(
        sources,
        options.corpus_options(),
        log=(lambda _: None) if quiet or not world.main else None,
        tokenizer=Tokenizer.load(out / "tokenizer.model") if options.resume else None,
        world=world,
    )
    tokenizer, train_ids, held_out_ids = prepared.tokenizer, prepared.train_ids, prepared.held_out_ids
    with Reporter(quiet or not world.main) as reporter:
        length = settings["context_length"]
        if len(train_ids) < length + 2 or len(held_out_ids) < 2:
            raise AftgenError(
                f"{corpus}: too small: {len(train_ids)} training tokens, fewer than one sequence of "
                f"{length + 1}; give it more text or pass a smaller --context-length"
            )
        eval_length = min(length, len(held_out_ids) - 1)

        torch.manual_seed(options.seed)
        config = AFTConfig(vocab_size=tokenizer.vocab_size, **{k: settings[k] for k in MODEL_FIELDS})
        model = AFTLM(config).to(placement.device)
        optimizer = make_optimizer(model, options)
        generator = torch.Generator().manual_seed(options.seed)
        step, elapsed_before = 0, 0.0
        metrics = _read_metrics(out) if options.resume else []
        if options.resume:
            info = _load_training_state(out, model, optimizer, generator)
            step, elapsed_before = info["step"], info["elapsed"]
            reporter.log(f"resuming {out} at step {step}")
            if saved.get("world_size", 1) != world.size:
                reporter.log(
                    f"note: trained so far by {saved.get('world_size', 1)} processes, now {world.size}: the global batch changes"
                )
        if world.rank:  # own dropout masks per process (the model's initialisation above is the same everywhere)
            torch.manual_seed(options.seed + 1_000_003 * world.rank + step)
        info = {
            "name": out.name,
            "command": options.command,
            "corpus": [str(source) for source in sources],
            "held_out": prepared.held_out,
            "settings": settings,
            "options": {k: v for k, v in asdict(options).items() if k not in ("corpus", "out", "extra")}
            | {"out": str(out)},
            "parameters": model.num_parameters(),
            "tokenizer_type": options.tokenizer_type,
            "device": placement.describe(),
            "world_size": world.size,
            "global_batch_size": settings["batch_size"] * world.size,
        }
        reporter.log(
            f"{model.num_parameters():,} parameters, vocabulary {tokenizer.vocab_size}, "
            f"{len(train_ids):,} training tokens, {len(held_out_ids):,} held-out tokens, on {placement.describe()}"
            + (f" x {world.size} processes (global batch {info['global_batch_size']})" if world.distributed else "")
            + f" -> {out}"
        )
        chars_per_token = prepared.held_out_chars / max(1, len(held_out_ids) - 1)
        batch_size = settings["batch_size"]

        saved_step = step if options.resume else None

        def diverged(what: str, at_step: int) -> AftgenError:
            kept = (
                f"the last good checkpoint (step {saved_step}) in {out} is kept"
                if saved_step is not None
                else "no checkpoint was written yet"
            )
            return AftgenError(
                f"{what} became NaN or inf at step {at_step}; {kept}. Try a lower learning rate (--lr {options.lr / 3:.2g})"
            )

        # With keep_best, model.safetensors holds the weights that scored best on the quick held-out
        # check (nanoGPT's always_save_checkpoint=False); the training state always holds the latest.
        best = saved.get("best") if options.resume else None

        def is_best(held_out: float) -> bool:
            nonlocal best
            if best is not None and held_out >= best["held_out_nats_per_char"]:
                return False
            best = {"step": step, "held_out_nats_per_char": held_out}
            return True

        def run_info(elapsed: float) -> dict:
            return info | {"step": step, "elapsed": elapsed, "best": best}

        def publish(state_info: dict) -> None:
            save_checkpoint(out, model, tokenizer, model_card(config, state_info, metrics), options.weights_dtype)

        def write_info(state_info: dict) -> None:
            atomic_write(out / TRAINING_INFO, json.dumps(state_info, indent=2) + "\n")

        def save(elapsed: float, improved: bool = False) -> None:
            nonlocal saved_step
            if not world.main:
                return
            if not all(
                torch.isfinite(p).all() for p in model.parameters()
            ):  # never replace good weights with broken ones
                raise diverged("the weights", step)
            state_info = run_info(elapsed)
            # The training state first (it alone is enough to resume), the marker training.json last.
            _save_training_state(out, model, optimizer, generator, state_info)
            if improved or not options.keep_best or not is_checkpoint(out):
                publish(state_info)
            write_info(state_info)
            saved_step = step

        def progress_of(elapsed: float) -> float:
            by_steps = step / options.max_steps
            return max(by_steps, elapsed / options.max_time) if options.max_time else by_steps

        trainer = world.wrap(model)
        if options.compile:
            trainer = compiled(trainer, reporter.log)
        # fp16 needs loss scaling so small gradients do not flush to zero; bf16 and fp32 do not.
        scaler = torch.amp.GradScaler(placement.device.type, enabled=placement.dtype == torch.float16)
        model.train()
        start = time.monotonic()
        tokens_seen, window_start, loss_sum, loss_count = 0, start, 0.0, 0
        stopped_by = None
        with _Interrupts() as interrupts:
            while True:
                # All processes must decide alike: rank 0's clock and a signal to any of them count for all.
                clock = elapsed_before + time.monotonic() - start
                elapsed, stop_votes = world.sum([clock if world.main else 0.0, float(interrupts.requested is not None)])
                if stop_votes:
                    stopped_by = interrupts.requested or "stop requested on another process"
                    break
                if progress_of(elapsed) >= 1.0:
                    break
                lr = learning_rate(options, step, progress_of(elapsed))
                for group in optimizer.param_groups:
                    group["lr"] = lr
                inputs, targets = data.batch(train_ids, batch_size, length, generator, world.rank, world.size)
                inputs, targets = inputs.to(placement.device), targets.to(placement.device)
                with placement.autocast():
                    logits = trainer(inputs)
                loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
                if not torch.isfinite(loss):
                    raise diverged("the loss", step + 1)
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()  # DDP averages the gradients over the processes here
                if options.grad_clip:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), options.grad_clip)
                scaler.step(optimizer)
                scaler.update()
                step += 1
                tokens_seen += inputs.numel() * world.size
                loss_sum, loss_count = loss_sum + loss.item(), loss_count + 1

                now = time.monotonic()
                tokens_per_s = tokens_seen / max(now - window_start, 1e-9)
                reporter.update(
                    step, progress_of(elapsed), f"loss {loss_sum / loss_count:.3f}  {tokens_per_s:,.0f} tok/s"
                )
                if step % options.eval_interval == 0:
                    train_loss = world.sum([loss_sum / loss_count])[0] / world.size  # over the global batch
                    if world.main:
                        held_out = _held_out_loss(model, held_out_ids, eval_length, options.eval_windows)
                        row = {
                            "step": step,
                            "elapsed": round(elapsed_before + now - start, 2),
                            "train_loss": train_loss,
                            "held_out_nats_per_char": held_out / chars_per_token,
                            "held_out_bits_per_char": held_out / chars_per_token / math.log(2),
                            "tokens_per_s": round(tokens_per_s, 1),
                            "lr": lr,
                        }
                        metrics.append(row)
                        _write_metrics(out, metrics)
                        reporter.log(
                            f"step {step}: train loss {row['train_loss']:.4f}, held-out "
                            f"{row['held_out_nats_per_char']:.4f} nats/char ({row['held_out_bits_per_char']:.4f} bits/char), "
                            f"{tokens_per_s:,.0f} tok/s"
                        )
                        if on_eval:
                            on_eval(row)
                        save(elapsed_before + now - start, improved=is_best(row["held_out_nats_per_char"]))
                    loss_sum, loss_count = 0.0, 0
                    tokens_seen, window_start = 0, time.monotonic()
            elapsed = elapsed_before + time.monotonic() - start
            last_checked = bool(metrics) and metrics[-1]["step"] == step
            if options.keep_best and world.main and not stopped_by and not last_checked:
                improved = is_best(
                    _held_out_loss(model, held_out_ids, eval_length, options.eval_windows) / chars_per_token
                )
            else:
                improved = False
            save(elapsed, improved)
        if stopped_by:
            reporter.log(
                f"{stopped_by}: saved step {step} to {out}; continue with: aftgen train {corpus} --out {out} --resume"
            )
            raise TrainingInterrupted(out)
        if not world.main:
            return out
        model.eval()
        # Scored as shipped: the published weights (the best ones with keep_best), at their stored precision.
        model.load_state_dict(read_weights(out / WEIGHTS, model))
        if options.keep_best:
            reporter.log(
                f"keeping the weights of step {best['step']} (quick held-out {best['held_out_nats_per_char']:.4f} nats/char)"
            )
        # Attention's KV cache grows with the stream (quadratic time to read it) and its RoPE positions
        # are untrained past the training length, so attention runs are scored in windows of that length.
        reset_every = config.context_length if config.mixer == "attention" else 0
        final = evaluate_ids(
            model, held_out_ids, prepared.held_out_chars, prepared.held_out_bytes, reset_every=reset_every
        )
        info["final_eval"] = final.to_dict() | {"reset_every": reset_every}
        state_info = run_info(elapsed)
        publish(state_info)
        write_info(state_info)
        reporter.log(
            f"done: {step} steps in {elapsed:.0f} s; held-out {final.nats_per_char:.4f} nats/char "
            f"({final.bits_per_char:.4f} bits/char)"
        )
    return out


class TrainingInterrupted(Exception):
    """Raised after an interrupted run has been saved."""

    def __init__(self, out: Path):
        super().__init__(str(out))
        self.out = out
