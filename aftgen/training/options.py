"""Everything `aftgen train` can be told, with its default and its allowed range: the one home of both."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from aftgen.checkpoint import WEIGHT_DTYPES
from aftgen.corpus import CorpusOptions
from aftgen.corpus.split import parse_size
from aftgen.device import DEVICES, DTYPES
from aftgen.errors import AftgenError
from aftgen.mixers import MIXERS, shaping_fields
from aftgen.model import PRESETS, AFTConfig
from aftgen.options import flag
from aftgen.sampling import check_seed
from aftgen.training.recipe import EVAL_WINDOWS

# AFTConfig fields a run may set (the rest come from the tokenizer); None in TrainOptions means "the preset's".
MODEL_FIELDS = ("n_layer", "n_embd", "n_head", "window", "context_length", "dropout", "decay", "mixer", "activation")
# What fine-tuning keeps from its base model; dropout, context length, batch and schedule may change.
ARCHITECTURE = ("n_layer", "n_embd", "n_head", "window", "decay", "mixer", "activation", "vocab_size")
OPTIMIZERS = ("adamw", "muon")
# What a fresh run's recipe (recipe.py) sets unless the user gives it: chosen from the corpus, the budget
# and the machine's speed once the corpus is read. None in TrainOptions means "not given".
RECIPE_FIELDS = ("preset", "activation", "optimizer", "dropout", "weight_decay", "ema", "lr",
                 "warmup_steps", "eval_interval", "eval_windows", "keep_best", "patience", "max_time")  # fmt: skip
# Fine-tuning keeps its own defaults (nanoGPT's finetune_shakespeare: a lower learning rate, a short
# warmup, only the best weights kept): a base model is a few steps from useful, so it is checked often.
FINE_TUNE_DEFAULTS = {"lr": 1e-3, "warmup_steps": 5, "eval_interval": 50, "eval_windows": EVAL_WINDOWS,
                      "keep_best": True, "optimizer": "adamw", "weight_decay": 0.1, "ema": 0.0,
                      "patience": 0}  # fmt: skip
FINE_TUNE_STEPS = 5000  # a fine-tuning run's budget when it is given none
FRESH_ONLY = {"preset": "small", "vocab_size": 1024, "tokenizer_type": "bpe"}  # fine-tuning takes the base's
MAX_BATCH_SIZE = 1 << 16  # sequences per step: more than any device holds, well before torch's sizes overflow


@dataclass
class TrainOptions:
    """Everything `aftgen train` can be told; None means "from the preset"."""

    corpus: Path | list[Path]  # text files and folders of them, each file a document
    out: Path | None = None
    init_from: str | None = None  # a checkpoint folder or OWNER/NAME[@REV] to fine-tune
    preset: str | None = None
    n_layer: int | None = None
    n_embd: int | None = None
    n_head: int | None = None
    window: int | None = None
    context_length: int | None = None
    batch_size: int | None = None
    dropout: float | None = None
    decay: bool | None = None
    mixer: str | None = None
    activation: str | None = None  # the MLP's (model.ACTIVATIONS)
    lr: float | None = None
    min_lr_ratio: float = 0.1
    weight_decay: float | None = None
    warmup_steps: int | None = None
    grad_clip: float = 1.0
    optimizer: str | None = None  # adamw | muon
    ema: float | None = None  # decay of the weight average that is checked and published; 0: the raw weights
    max_steps: int | None = None
    max_time: float | str | None = None  # seconds, or a duration such as "10m"
    eval_interval: int | None = None
    eval_windows: int | None = None
    keep_best: bool | None = None
    patience: int | None = None  # stop after this many held-out checks without a new best; 0: run the whole budget
    weights_dtype: str = "fp32"
    seed: int = 1337
    vocab_size: int | None = None
    tokenizer_type: str | None = None
    encoding: str = "utf-8"
    errors: str = "strict"
    glob: str = CorpusOptions.glob
    held_out: int | str = CorpusOptions.held_out  # characters at most, or a size such as "500k"
    skip_bad_files: bool = False
    resume: bool = False
    overwrite: bool = False
    device: str = "auto"
    dtype: str = "auto"
    compile: bool = False
    command: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.max_time, str):
            self.max_time = parse_duration(self.max_time)
        if isinstance(self.held_out, str):
            self.held_out = parse_size(self.held_out)
        if self.init_from:
            self.fill(FINE_TUNE_DEFAULTS)
            if self.max_time is None and self.max_steps is None:
                self.max_steps = FINE_TUNE_STEPS
        else:
            self.fill({name: FRESH_ONLY[name] for name in ("vocab_size", "tokenizer_type")})

    def fill(self, values: dict) -> None:
        """Set the options the user did not give (None) from `values`."""
        for name, value in values.items():
            if getattr(self, name) is None:
                setattr(self, name, value)

    @property
    def sizes_given(self) -> bool:
        """Whether the user named the model's size (a preset, or any size): the recipe then keeps it."""
        return any(
            getattr(self, name) is not None
            for name in ("preset", "n_layer", "n_embd", "n_head", "window", "context_length", "batch_size")
        )

    @property
    def run_folder(self) -> Path:
        return Path(self.out) if self.out else Path("runs") / self.sources()[0].stem

    def sources(self) -> list[Path]:
        return [Path(self.corpus)] if isinstance(self.corpus, (str, Path)) else [Path(p) for p in self.corpus]

    def corpus_options(self) -> CorpusOptions:
        """How to read and tokenize the corpus (a fine-tuning run's tokenizer is the base model's)."""
        fresh = {name: getattr(self, name) or FRESH_ONLY[name] for name in ("vocab_size", "tokenizer_type")}
        names = ("glob", "held_out", "skip_bad_files", "encoding", "errors")
        return CorpusOptions(**{name: getattr(self, name) for name in names}, **fresh)

    def resolved(self, base: AFTConfig | None = None) -> dict:
        """The model's sizes and the batch size: the preset's, or the base model's when fine-tuning,
        with explicit options laid over them."""
        if base is not None:
            self._refuse_architecture_changes(base)
            settings = {name: getattr(base, name) for name in MODEL_FIELDS}
            settings["batch_size"] = PRESETS[FRESH_ONLY["preset"]]["batch_size"]
        else:
            preset = self.preset or FRESH_ONLY["preset"]
            if preset not in PRESETS:
                raise AftgenError(f"unknown preset '{preset}'; choose one of: {', '.join(PRESETS)}")
            # AFTConfig's defaults: what an older run folder's record, without these fields, was trained with
            settings = {name: getattr(AFTConfig, name) for name in ("dropout", "decay", "mixer", "activation")}
            settings |= PRESETS[preset]
        for name in (*MODEL_FIELDS, "batch_size"):
            if getattr(self, name) is not None:
                settings[name] = getattr(self, name)
        return settings

    def _refuse_architecture_changes(self, base: AFTConfig) -> None:
        """Fine-tuning keeps the base model's tokenizer and architecture: an option saying otherwise is an error."""
        for name in FRESH_ONLY:
            if getattr(self, name) is not None and name not in ARCHITECTURE:
                raise AftgenError(f"{flag(name)}: fine-tuning keeps the base model's tokenizer and sizes; drop it")
        kept = (*ARCHITECTURE, *shaping_fields(base))  # aft_full's window, for one, is its training length
        changed = [name for name in kept if getattr(self, name) not in (None, getattr(base, name))]
        if changed:
            name = changed[0]
            raise AftgenError(
                f"{flag(name)} {getattr(self, name)} contradicts the base model ({name} {getattr(base, name)}); "
                f"fine-tuning keeps the base model's architecture and tokenizer: drop {flag(name)}"
            )

    def to_dict(self) -> dict:
        """The options as training.json records them."""
        recorded = {k: v for k, v in asdict(self).items() if k not in ("corpus", "out")}
        return recorded | {"out": str(self.run_folder)}

    def check(self) -> None:
        """Refuse out-of-range values before any work is done."""
        check_seed(self.seed)
        if self.batch_size is not None and self.batch_size > MAX_BATCH_SIZE:
            raise AftgenError(f"--batch-size must be at most {MAX_BATCH_SIZE}, got {self.batch_size}")
        for name in ("lr", "max_steps", "eval_interval", "eval_windows", "vocab_size"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise AftgenError(f"{flag(name)} must be positive, got {getattr(self, name)}")
        for name in ("warmup_steps", "weight_decay", "grad_clip", "patience"):
            if getattr(self, name) is not None and not getattr(self, name) >= 0:
                raise AftgenError(f"{flag(name)} must not be negative, got {getattr(self, name)}")
        if self.ema is not None and not 0 <= self.ema < 1:
            raise AftgenError(f"--ema must be in [0, 1) (0 turns it off; 0.99 to 0.999 are usual), got {self.ema}")
        if self.patience and self.keep_best is False:
            raise AftgenError("--patience needs --keep-best, so that the run publishes the best weights, not the last")
        if self.max_time is not None and not self.max_time > 0:
            raise AftgenError(f"--max-time must be positive, got {self.max_time}")
        if self.optimizer is not None:
            _one_of("--optimizer", self.optimizer, OPTIMIZERS)
        _one_of("--device", self.device.split(":")[0], DEVICES, shown=self.device)
        _one_of("--dtype", self.dtype, ("auto", *DTYPES))
        _one_of("--weights-dtype", self.weights_dtype, tuple(WEIGHT_DTYPES))
        self.corpus_options().check()
        if self.init_from:
            return  # the sizes come from the base model, checked against it once it is read (resolved)
        settings = self.resolved()
        _one_of("--mixer", settings["mixer"], tuple(MIXERS))
        for name in ("batch_size", "n_layer", "n_embd", "n_head", "context_length"):
            if settings[name] <= 0:
                raise AftgenError(f"{flag(name)} must be positive, got {settings[name]}")
        AFTConfig(vocab_size=self.vocab_size, **{k: settings[k] for k in MODEL_FIELDS})  # window <= context, ...


def _one_of(option: str, value: str, allowed: tuple[str, ...], shown: str | None = None) -> None:
    if value not in allowed:
        raise AftgenError(f"unknown {option} '{shown or value}'; choose one of: {', '.join(allowed)}")


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
