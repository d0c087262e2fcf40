"""`aftgen bench`: the paper's comparison on this machine. Every token mixer at the same width and
depth, timed in the same run, reported as ratios against attention (machine noise cancels in a ratio)."""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from aftgen.bench.measure import fastest_side_by_side, in_fresh_process, memory_mb, read_until, step_timer
from aftgen.bench.targets import BASELINE, SUBJECT, TARGETS, Row
from aftgen.compiled.step import compile_step
from aftgen.device import synchronize
from aftgen.errors import AftgenError
from aftgen.generation.prompt import PROMPT_CHUNK
from aftgen.mixers import fixed_size_state
from aftgen.mixers.attention import filled_cache
from aftgen.model import AFTLM, AFTConfig
from aftgen.training.probe import training_step

TRAIN_LENGTHS = (256, 1024, 4096)
TOKENS_PER_STEP = 4096  # batch = TOKENS_PER_STEP // length, so every length does the same work per step
DECODE_CONTEXTS = (1_000, 8_000, 32_000)
POSITION_BINS = ((0, 1_000), (1_000, 8_000), (8_000, None))
WARM_UP_STEPS = 2  # untimed steps per probe: the first few run slower while the allocator's pools grow
Log = Callable[[str], None]


def comparison_model(mixer: str, context_length: int, preset: str = "small", vocab_size: int = 1024) -> AFTLM:
    """A preset's width and depth with the given mixer and training length, randomly initialised."""
    return AFTLM(AFTConfig.from_preset(preset, vocab_size, context_length=context_length, mixer=mixer))


def probe(
    kind: str, mixer: str, length: int, repeats: int, threads: int, device: str = "cpu", dtype: str = "fp32"
) -> dict:
    """Time `kind` ("train": a full step, forward + backward + AdamW; "mixer": the token mixer alone,
    forward + backward) and its peak memory (the GPU's, on a GPU) on `device` under `dtype` autocast.
    Meant for a fresh process (in_fresh_process)."""
    from aftgen.device import resolve

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    placement = resolve(device, dtype)
    batch = max(1, TOKENS_PER_STEP // length)
    model = comparison_model(mixer, length).to(placement.device).train()
    pass_of = training_step if kind == "train" else _mixer_pass
    run = pass_of(model, batch, length, placement.autocast)
    resting, _ = memory_mb(placement.device)
    for _ in range(WARM_UP_STEPS):  # first-call allocations, the optimiser's moments, the allocator's pools
        run()
    times = []
    for _ in range(repeats):
        synchronize(placement.device)
        start = time.perf_counter()
        run()
        synchronize(placement.device)
        times.append(time.perf_counter() - start)
    best = min(times)  # the least disturbed run: other processes only ever add time
    peak = memory_mb(placement.device)[1] - resting
    return {"seconds": best, "tokens_per_s": batch * length / best, "peak_mb": peak, "batch": batch}


def _mixer_pass(model: AFTLM, batch: int, length: int, autocast: Callable) -> Callable[[], None]:
    mixer = model.blocks[0].mixer
    x = torch.randn(batch, length, model.config.n_embd, device=model.embed.weight.device, requires_grad=True)
    grad = torch.randn_like(x)

    def run() -> None:
        with autocast():
            y, _ = mixer(x)
        y.backward(grad.to(y.dtype))

    return run


def with_ratios(rows: list[Row]) -> list[Row]:
    """Add each row's ratio against the baseline mixer's row of the same measure and length."""
    base = {(r["measure"], r.get("length"), r.get("context")): r["value"] for r in rows if r["mixer"] == BASELINE}
    for r in rows:
        reference = base.get((r["measure"], r.get("length"), r.get("context")))
        if reference:
            r["vs_attention"] = round(r["value"] / reference, 3)
    return rows


def bench_train(
    mixers: tuple[str, ...],
    repeats: int = 3,
    rounds: int = 2,
    log: Log = print,
    lengths: tuple[int, ...] = TRAIN_LENGTHS,
    device: str = "cpu",
    dtype: str = "fp32",
) -> list[Row]:
    """Training-step tokens/s and peak memory, and the mixer alone, per mixer and length, on `device`
    under `dtype` autocast (on a GPU in bf16, attention runs PyTorch's flash kernel).

    Every configuration is probed `rounds` times, the rounds going over all of them in turn, and the
    fastest round counts: a slow spell of a shared machine then cannot sink one mixer's figure alone.
    """
    for name, value in (("--repeats", repeats), ("--rounds", rounds)):
        if value < 1:
            raise AftgenError(f"{name} must be >= 1, got {value}")
    fastest: dict[tuple[str, str, int], dict] = {}
    for round_number in range(1, rounds + 1):
        for length in lengths:
            for mixer in mixers:
                for kind in ("train", "mixer"):
                    got = in_fresh_process(probe, kind, mixer, length, repeats, torch.get_num_threads(), device, dtype)
                    if (kind, mixer, length) not in fastest or got["seconds"] < fastest[kind, mixer, length]["seconds"]:
                        fastest[kind, mixer, length] = got
                train, alone = fastest["train", mixer, length], fastest["mixer", mixer, length]
                log(
                    f"  round {round_number}/{rounds}, T={length} {mixer}: train step "
                    f"{train['tokens_per_s']:,.1f} tokens/s, peak memory {train['peak_mb']:,.1f} MB; mixer fwd+bwd "
                    f"{alone['seconds'] * 1e3:,.1f} ms, peak memory {alone['peak_mb']:,.1f} MB (fastest so far)"
                )
    return with_ratios([row for key, got in fastest.items() for row in _probe_rows(*key, got)])


def _probe_rows(kind: str, mixer: str, length: int, got: dict) -> list[Row]:
    where = {"mixer": mixer, "length": length, "batch": got["batch"]}
    peak = round(got["peak_mb"], 1)
    if kind == "train":
        return [
            {"measure": "train step", "value": round(got["tokens_per_s"], 1), "unit": "tokens/s", **where},
            {"measure": "train peak memory", "value": peak, "unit": "MB", **where},
        ]
    return [
        {"measure": "mixer fwd+bwd", "value": round(got["seconds"] * 1e3, 2), "unit": "ms", **where},
        {"measure": "mixer peak memory", "value": peak, "unit": "MB", **where},
    ]


def bench_decode(repeats: int = 100, log: Log = print) -> list[Row]:
    """Per-token latency at batch 1 after 1k, 8k, 32k tokens, and the state's size: aft_local's
    recurrent state against attention's KV cache, each with the fastest step aftgen has for it.

    aft_local's fixed-shape step compiles (`aftgen sample --compile`); its eager latency is shown
    too. Attention's step stays eager: its cache grows every token, and at long contexts its time
    goes to reading that cache, which no fusion shortens.
    """
    rows: list[Row] = []
    ids = torch.randint(0, 1024, (1, PROMPT_CHUNK), generator=torch.Generator().manual_seed(0))
    for mixer in (SUBJECT, BASELINE):
        torch.manual_seed(0)
        model = comparison_model(mixer, 128).eval()
        step, note = compile_step(model) if fixed_size_state(mixer) else (model.step, "eager")
        state = model.initial_state(1)
        for context in DECODE_CONTEXTS:
            if fixed_size_state(mixer):  # the real thing: read random tokens in the parallel form
                state = read_until(model, ids, state, context)
            else:
                heads, head_dim = model.blocks[0].mixer.n_head, model.blocks[0].mixer.head_dim
                state = [filled_cache(1, heads, head_dim, context, room=300) for _ in state]
            new = _decode_rows(model, step, note, state, mixer, context, repeats)
            rows += new
            latency, size = new[0]["value"], new[-1]["value"]
            log(f"  {mixer} after {context:,} tokens: {latency:.2f} ms/token ({note}), state {size:.2f} MB")
    return with_ratios(rows)


def _decode_rows(model: AFTLM, step, note: str, state, mixer: str, context: int, repeats: int) -> list[Row]:
    where = {"mixer": mixer, "context": context}
    timers = {"step": step_timer(step, state, repeats // 5)}
    if step != model.step:  # bound methods: equal, never identical
        timers["eager"] = step_timer(model.step, state, repeats // 5)
    ms = fastest_side_by_side(timers)
    size = sum(t.numel() * t.element_size() for layer in state for t in layer.values()) / 2**20
    rows = [{"measure": "decode step", "value": round(ms["step"], 3), "unit": "ms/token", "step": note, **where}]
    if "eager" in ms:
        rows.append({"measure": "decode step, eager", "value": round(ms["eager"], 3), "unit": "ms/token", **where})
    rows.append({"measure": "decode state memory", "value": round(size, 3), "unit": "MB", **where})
    return rows


def bench_quality(corpus: Path, seconds: float, mixers: tuple[str, ...], log: Log = print) -> list[Row]:
    """Train each mixer for the same wall time on the same split; held-out nats/char and bits/char.

    Every mixer is scored the same way: the held-out text in windows of the training length (the
    paper's protocol, and the most context attention was trained for). aft_local is also read as
    one stream, by position, to show whether its quality holds past the training length.
    """
    from aftgen.checkpoint import load_checkpoint
    from aftgen.corpus import prepare_corpus
    from aftgen.evaluate import evaluate_ids
    from aftgen.training import recipe
    from aftgen.training.loop import train
    from aftgen.training.options import TrainOptions

    if not seconds > 0:
        raise AftgenError(f"--time must be positive, got {seconds}")
    data = prepare_corpus([corpus], TrainOptions(corpus=corpus).corpus_options(), log=lambda _: None)
    ids, chars, nbytes = data.held_out_ids.long(), data.held_out_chars, data.held_out_bytes
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="aftgen-bench-") as folder:
        for mixer in mixers:
            log(f"  training {mixer} for {seconds:g} s ...")
            out = Path(folder) / mixer
            options = TrainOptions(
                corpus, out, mixer=mixer, max_time=seconds, max_steps=10**9, eval_interval=10**9, **recipe.FIXED
            )
            model, tokenizer = load_checkpoint(train(options, quiet=True))
            result = evaluate_ids(model, ids, chars, nbytes, reset_every=model.config.context_length)
            eval_kind = f"windows of {model.config.context_length} tokens"
            where = {"mixer": mixer, "train_seconds": seconds, "eval": eval_kind}
            rows.append({"measure": "held-out", "value": round(result.nats_per_char, 4), "unit": "nats/char", **where})
            rows.append({"measure": "held-out", "value": round(result.bits_per_char, 4), "unit": "bits/char", **where})
            log(f"  {mixer}: {result.nats_per_char:.4f} nats/char ({result.bits_per_char:.4f} bits/char)")
            if mixer == SUBJECT:
                rows += _stream_rows(model, tokenizer, ids, log)
    base = {r["unit"]: r["value"] for r in rows if r["mixer"] == BASELINE and r["measure"] == "held-out"}
    for r in rows:
        if r["measure"] == "held-out" and r["unit"] in base:
            r["vs_attention"] = round(r["value"] - base[r["unit"]], 4)  # a difference: lower is better
    return rows


def _stream_rows(model: AFTLM, tokenizer, ids: torch.Tensor, log: Log) -> list[Row]:
    """The held-out ids read as one stream, scored by position: does quality hold past the training length?"""
    from aftgen.evaluate import stream_nll

    nll, rows = stream_nll(model, ids), []
    for low, high in POSITION_BINS:
        if low >= len(nll):
            continue
        chars = len(tokenizer.decode(ids[1 + low : 1 + (high or len(nll))].tolist()))
        nats = float(nll[low:high].double().sum()) / max(chars, 1)
        span = f"{low // 1000}k-{high // 1000}k" if high else f">{low // 1000}k"
        where = {"mixer": SUBJECT, "tokens": span}
        rows.append({"measure": "held-out, one stream", "value": round(nats, 4), "unit": "nats/char", **where})
        log(f"  {SUBJECT} stream, tokens {span}: {nats:.4f} nats/char ({nats / math.log(2):.4f} bits/char)")
    return rows


# Which rows each comparison target reads: (target, measure, where).
COMPARED = (
    ("train T=256", "train step", {"length": 256}),
    ("train T=1024", "train step", {"length": 1024}),
    ("train T=4096", "train step", {"length": 4096}),
    ("train memory T=4096", "train peak memory", {"length": 4096}),
    ("mixer time T=1024", "mixer fwd+bwd", {"length": 1024}),
    ("decode after 32k", "decode step", {"context": 32_000}),
    ("quality", "held-out", {"unit": "nats/char"}),
)


def comparison_targets(rows: list[Row]) -> list[Row]:
    """The targets of TARGETS that the measured rows allow judging, aft_local against attention."""

    def ratio(measure: str, where: dict) -> float | None:
        for r in rows:
            if r["measure"] == measure and r["mixer"] == SUBJECT and all(r.get(k) == v for k, v in where.items()):
                return r.get("vs_attention")
        return None

    judged = [(name, ratio(measure, where)) for name, measure, where in COMPARED]
    targets = [TARGETS[name].judge(value) for name, value in judged if value is not None]
    memory = [r["value"] for r in rows if r["measure"] == "decode state memory" and r["mixer"] == SUBJECT]
    if memory:
        targets.append(TARGETS["decode state growth"].judge(memory[-1] - memory[0]))
    return targets
