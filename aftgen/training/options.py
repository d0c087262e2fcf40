"""Everything `aftgen train` can be told: each option's default, range and help declared once, as a field of
TrainOptions (the command line, the checks, aftgen.training.plan and docs/reference.md read them), beside the
tables its values come from. None means "not given": aftgen.training.plan settles such an option, from the layers
below the user's (a resumed run's record, FINE_TUNE_DEFAULTS, the recipe, the preset) in the order it documents.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from aftgen.checkpoint import WEIGHT_DTYPES
from aftgen.corpus import CorpusOptions
from aftgen.corpus.split import parse_size
from aftgen.device import DEVICES, DTYPES
from aftgen.errors import AftgenError
from aftgen.generation.controls import check_seed
from aftgen.mixers import MIXERS
from aftgen.model import ACTIVATIONS, PRESETS
from aftgen.options import (
    DATA_PANEL,
    HARDWARE_PANEL,
    MODEL_PANEL,
    POSITIVE,
    TRAIN_PANEL,
    Range,
    declared,
    flag,
    option,
)
from aftgen.tokenizer import TOKENIZER_TYPES
from aftgen.training import vocabulary
from aftgen.training.recipe import CANDIDATES, DEFAULT_BUDGET, EVAL_WINDOWS

# AFTConfig fields a run may set (the rest come from the tokenizer).
MODEL_FIELDS = ("n_layer", "n_embd", "n_head", "window", "context_length", "dropout", "decay", "mixer", "activation")
# Options that size the model or its steps: given any, a fresh run keeps them (the recipe then chooses no size).
SIZES = ("preset", "n_layer", "n_embd", "n_head", "window", "context_length", "batch_size")
SIZES_PRESET = CANDIDATES[0]  # the preset that sizes given without --preset are laid over
# What fine-tuning keeps from its base model; dropout, context length, batch and schedule may change.
ARCHITECTURE = ("n_layer", "n_embd", "n_head", "window", "decay", "mixer", "activation", "vocab_size")
FRESH_ONLY = ("preset", "vocab_size", "tokenizer_type")  # a fine-tuning run takes the base model's
OPTIMIZERS = ("adamw", "muon")
# What a fresh run's recipe (recipe.py) sets unless the user gives it.
RECIPE_FIELDS = ("preset", "activation", "optimizer", "dropout", "weight_decay", "ema", "lr",
                 "warmup_steps", "eval_interval", "eval_windows", "keep_best", "patience", "max_time")  # fmt: skip
# Fine-tuning keeps its own defaults (nanoGPT's finetune_shakespeare: a lower learning rate, a short
# warmup, only the best weights kept): a base model is a few steps from useful, so it is checked often.
FINE_TUNE_DEFAULTS = {"lr": 1e-3, "warmup_steps": 5, "eval_interval": 50, "eval_windows": EVAL_WINDOWS,
                      "keep_best": True, "optimizer": "adamw", "weight_decay": 0.1, "ema": 0.0,
                      "patience": 0}  # fmt: skip
FINE_TUNE_STEPS = 5000  # a fine-tuning run's budget when it is given none
# Options of this command, not of the run it trains: a resumed run reads them from its command line, never its record.
THIS_COMMAND = ("corpus", "out", "resume", "overwrite", "command", "device", "compile")
# What a resumed run may be given anew besides those: its budget, and its dtype. Every other option it keeps as it
# was started (aftgen.training.plan refuses one given otherwise: the run would no longer be the run it resumes).
RESUME_MAY_CHANGE = ("max_steps", "max_time", "dtype")
MAX_BATCH_SIZE = 1 << 16  # sequences per step: more than any device holds, well before torch's sizes overflow
# Budgets beyond any run's, well before the recipe's arithmetic (steps, passes) overflows a float.
MAX_TIME = 365 * 24 * 3600  # seconds: a year
MAX_STEPS = 10**12
NOT_NEGATIVE = Range(0)
# The options whose values come from a table: --help lists the table, the check refuses anything else. The tables
# themselves, not copies, so that a mixer registered at run time is a choice.
CHOICES: dict[str, Collection[str]] = {"preset": PRESETS, "mixer": MIXERS, "activation": ACTIVATIONS,
                                       "optimizer": OPTIMIZERS, "weights_dtype": WEIGHT_DTYPES,
                                       "tokenizer_type": TOKENIZER_TYPES}  # fmt: skip


def _listed(name: str) -> str:
    return " | ".join(CHOICES[name])


def _chosen(name: str | None = None) -> str:
    """The default of an option the recipe sets (and fine-tuning's, where it has its own)."""
    fine_tuning = f"; fine-tuning: {FINE_TUNE_DEFAULTS[name]}" if name in FINE_TUNE_DEFAULTS else ""
    return f"Default: the recipe's{fine_tuning}."


def _model(help: str, range: Range | None = None, name: str | None = None) -> Any:
    return option(None, help, range, MODEL_PANEL, flags=(flag(name),) if name else ())


def _training(default: Any, help: str, range: Range | None = None) -> Any:
    return option(default, help, range, TRAIN_PANEL)


@dataclass(frozen=True)
class TrainOptions:
    """Everything `aftgen train` can be told, as given: None means "not given" (aftgen.training.plan settles it)."""

    corpus: Path | list[Path]  # text files and folders of them, each file a document
    out: Path | None = option(None, "Run folder (default runs/<corpus-stem>).")
    resume: bool = option(False, "Continue the run in --out where it stopped.")
    overwrite: bool = option(False, "Replace a run already in --out.")
    init_from: str | None = option(
        None,
        "Fine-tune this model (a checkpoint folder or OWNER/NAME\\[@REV] from the Hub): its tokenizer and "
        "architecture are kept, the optimiser starts fresh, the batch size is its run's, and the defaults become "
        + ", ".join(f"{flag(name)} {value}" for name, value in FINE_TUNE_DEFAULTS.items())
        + ".",
        panel=TRAIN_PANEL,
    )
    preset: str | None = _model(f"{_listed('preset')}. {_chosen()}")
    n_layer: int | None = _model("Blocks. Default: the preset's.", POSITIVE, "n_layer")
    n_embd: int | None = _model("Embedding width. Default: the preset's.", POSITIVE, "n_embd")
    n_head: int | None = _model("Heads (a divisor of the width). Default: the preset's.", POSITIVE, "n_head")
    mixer: str | None = _model(
        "Token mixer: " + " | ".join(f"{name} ({kind.about})" for name, kind in MIXERS.items()) + "."
    )
    window: int | None = _model("AFT-local window s. Default: the preset's.")
    context_length: int | None = _model("Training sequence length. Default: the preset's.", POSITIVE)
    dropout: float | None = _model(_chosen())
    decay: bool | None = _model("Learned decay beyond the window (off: the paper's AFT-local).")
    activation: str | None = _model(f"The MLP's: {_listed('activation')}. {_chosen()}")
    max_steps: int | None = _training(
        None, f"Step budget (default: none; fine-tuning: {FINE_TUNE_STEPS}).", Range(0, MAX_STEPS, open_low=True)
    )
    # seconds, or a duration such as "10m" (the command line passes it as text)
    max_time: float | str | None = _training(
        None,
        f"Wall-time budget: 150, 90s, 10m, 1h. Default: {DEFAULT_BUDGET / 60:g}m unless --max-steps is given. "
        "A fresh run chooses its recipe (model size, regularisation, schedule) for its corpus and this budget.",
        Range(0, MAX_TIME, open_low=True),
    )
    batch_size: int | None = _training(
        None,
        "Sequences per step. Default: the preset's; fine-tuning: the base model's run's.",
        Range(0, MAX_BATCH_SIZE, open_low=True),
    )
    lr: float | None = _training(None, "Peak learning rate. " + _chosen("lr"), POSITIVE)
    min_lr_ratio: float = 0.1  # where the cosine decay ends, as a fraction of lr (not a command-line option)
    warmup_steps: int | None = _training(None, _chosen("warmup_steps"), NOT_NEGATIVE)
    weight_decay: float | None = _training(None, _chosen(), NOT_NEGATIVE)
    grad_clip: float = _training(1.0, "Clip the gradients' norm to this (0: off).", NOT_NEGATIVE)
    optimizer: str | None = _training(
        None, f"{_listed('optimizer')} (Muon for the blocks' matrices, AdamW for the rest). " + _chosen("optimizer")
    )
    ema: float | None = _training(
        None,
        "Check and publish an exponential moving average of the weights with this decay (e.g. 0.995); 0: off. "
        + _chosen(),
        Range(0, 1, open_high=True),
    )
    eval_interval: int | None = _training(
        None, "Steps between held-out evals and checkpoints. " + _chosen("eval_interval"), POSITIVE
    )
    eval_windows: int | None = _training(
        None, "Held-out windows each eval scores. " + _chosen("eval_windows"), POSITIVE
    )
    keep_best: bool | None = _training(
        None, "Publish the weights that scored best on the held-out eval, not the latest. " + _chosen("keep_best")
    )
    patience: int | None = _training(
        None,
        "Stop after this many held-out evals without a new best (needs --keep-best); 0: run the whole budget. "
        + _chosen(),
        NOT_NEGATIVE,
    )
    weights_dtype: str = _training(
        "fp32", f"{_listed('weights_dtype')}: precision of model.safetensors (fp16 halves it)."
    )
    seed: int = _training(1337, "Seeds the weights, the batches and dropout.")
    vocab_size: int | None = option(
        None,
        f"Default: the recipe's, of {', '.join(map(str, vocabulary.CANDIDATES))} (with a budget in steps: "
        f"{CorpusOptions.vocab_size}; fine-tuning: the base model's).",
        POSITIVE,
        DATA_PANEL,
    )
    tokenizer_type: str | None = option(
        None, f"{_listed('tokenizer_type')} (default: {CorpusOptions.tokenizer_type}).", panel=DATA_PANEL
    )
    encoding: str = CorpusOptions.encoding
    errors: str = CorpusOptions.errors
    glob: str = CorpusOptions.glob
    held_out: int | str = CorpusOptions.held_out  # characters at most, or a size such as "500k"
    skip_bad_files: bool = CorpusOptions.skip_bad_files
    device: str = "auto"
    dtype: str = "auto"
    compile: bool = option(
        False, "torch.compile the training model (falls back to eager).", panel=HARDWARE_PANEL,
        flags=("--compile/--no-compile",),
    )  # fmt: skip
    command: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.max_time, str):
            object.__setattr__(self, "max_time", parse_duration(self.max_time))
        if isinstance(self.held_out, str):
            object.__setattr__(self, "held_out", parse_size(self.held_out))

    def given(self, names: tuple[str, ...] | dict) -> dict:
        """The options among `names` that the user gave (not None)."""
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def differs_from_default(self, name: str) -> bool:
        """Whether option `name` says anything: not None, and not its default (for an option that has one, the
        only sign that the user gave it)."""
        return getattr(self, name) not in (None, _DEFAULTS[name])

    @property
    def run_folder(self) -> Path:
        return Path(self.out) if self.out else Path("runs") / self.sources()[0].stem

    def sources(self) -> list[Path]:
        return [Path(self.corpus)] if isinstance(self.corpus, (str, Path)) else [Path(p) for p in self.corpus]

    def corpus_options(self) -> CorpusOptions:
        """How to read and tokenize the corpus (a fine-tuning run's tokenizer is the base model's); the run's own
        folder, should it lie in a corpus folder, is no part of it."""
        names = ("glob", "held_out", "skip_bad_files", "encoding", "errors", "vocab_size", "tokenizer_type")
        return CorpusOptions(**self.given(names), leave_out=(self.run_folder,))

    def to_dict(self) -> dict:
        """The options as training.json records them."""
        recorded = {k: v for k, v in asdict(self).items() if k not in ("corpus", "out")}
        return recorded | {"out": str(self.run_folder)}

    def check(self) -> None:
        """Refuse what the user gave out of its range or table, before any work is done (aftgen.training.plan
        checks the run's settled whole: the model's sizes together, against the corpus and the base model)."""
        check_seed(self.seed)
        for name, (_, _, declaration) in declared(TrainOptions).items():
            value = getattr(self, name)
            if declaration.range is not None and value is not None and value not in declaration.range:
                raise AftgenError(f"{flag(name)} must {_words(declaration.range, value)}, got {value}")
        for name, allowed in CHOICES.items():
            if name != "tokenizer_type" and getattr(self, name) is not None:  # the corpus options' check has it
                _one_of(flag(name), getattr(self, name), allowed)
        if self.patience and self.keep_best is False:
            raise AftgenError("--patience needs --keep-best, so that the run publishes the best weights, not the last")
        _one_of("--device", self.device.split(":")[0], DEVICES, shown=self.device)
        _one_of("--dtype", self.dtype, ("auto", *DTYPES))
        self.corpus_options().check()


_DEFAULTS = {field.name: field.default for field in fields(TrainOptions)}


def _words(allowed: Range, value: float) -> str:
    """What a value outside `allowed` must be, as a person says it ("be positive", "be at most 65536")."""
    if value in Range(allowed.low, open_low=allowed.open_low):  # too high
        return f"be {allowed}" if allowed.open_high else f"be at most {allowed.high}"
    if allowed.low == 0:
        return "be positive" if allowed.open_low else "not be negative"
    return f"be {allowed}"


def _one_of(option: str, value: str, allowed: Collection[str], shown: str | None = None) -> None:
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
    if math.isnan(seconds) or seconds <= 0:  # too long (inf, too) is --max-time's range check's to refuse
        raise AftgenError(f"duration must be positive, got '{text}'")
    return seconds
