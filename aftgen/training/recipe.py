"""The recipe: what a fresh run trains when the user does not say, chosen from the corpus size, the
budget (time or steps) and the machine's measured speed. Every explicit option wins over it.

The choice reads three tables, each set by measurements (docs/recipe.md has the runs):

- the model size: the largest preset that has at least MIN_TOKENS_PER_PARAMETER training tokens per
  parameter (below that it memorises the text before it generalises: on Tiny Shakespeare the small
  model with heavy dropout beats the medium one at any budget) and gets, within the budget, at least
  MIN_STEPS steps and either ENOUGH_PASSES passes over the corpus or ENOUGH_TOKENS_PER_PARAMETER
  tokens per parameter (Chinchilla's rule); where none does, the smallest;
- the regularisation (dropout, weight decay, weight average) from how many passes over the
  training tokens the budget buys: a run that sees its text dozens of times needs heavy dropout,
  one that reads it once needs none;
- the learning rate of each size.

Every recipe keeps the best held-out check and stops PATIENCE checks after it, so no run publishes
weights that its own checks saw get worse.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TypeVar

from aftgen.model import PRESETS, AFTConfig

DEFAULT_BUDGET = 15 * 60.0  # seconds, when neither --max-time nor --max-steps is given
CANDIDATES = ("small", "medium", "large")  # model sizes the recipe chooses among, smallest first
MIN_TOKENS_PER_PARAMETER = 0.1
MIN_STEPS = 1000
ENOUGH_PASSES = 10
ENOUGH_TOKENS_PER_PARAMETER = 20
# AdamW: Muon (--optimizer muon) learned faster per step on short runs but has not yet won at equal wall
# time on two corpora (docs/recipe.md), so the recipe does not choose it.
OPTIMIZER = "adamw"
# ReLU squared in the MLP: with weight decay 1.0 (the table below) it learns faster than GELU on every corpus
# measured, where GELU with weight decay 1.0 lost on one (docs/recipe.md).
ACTIVATION = "relu2"
LEARNING_RATES = {"tiny": 3e-3, "small": 2e-3, "medium": 1.5e-3, "large": 1e-3}
WARMUP_FRACTION, MIN_WARMUP, MAX_WARMUP = 0.02, 20, 200  # of the expected steps
CHECKS_PER_RUN = 25  # held-out checks spread over the budget (patience counts them)
EVAL_WINDOWS = 100  # windows each check scores: fewer let noise end a run early
PATIENCE = 3
FASTER_ENOUGH = 1.15  # bf16 autocast is chosen on a CPU only when measured at least this much faster
# Candidates the recipe chooses between by speed (dtypes, vocabularies) are each timed this many times, in turn,
# and their best kept: one slow measurement (a busy moment) once chose fp32 on a machine where bf16 trains 1.5
# times as fast, and, timed once, the 30 MB corpus's 4096 pieces ran at 0.54-0.78 of 2048's speed from run to run.
ROUNDS = 2
Candidate = TypeVar("Candidate")
# aftgen's defaults before it had a recipe, spelled out: for comparing other things (mixers) at fixed settings.
# `aftgen bench mixers` gives them as the user's own options, so they win over every default (training/plan.py).
FIXED = {"preset": "small", "activation": "gelu", "optimizer": "adamw", "dropout": 0.0,
         "weight_decay": 0.1, "ema": 0.0, "lr": 2e-3, "warmup_steps": 100, "keep_best": False,
         "patience": 0, "vocab_size": 1024}  # fmt: skip


@dataclass(frozen=True)
class Regularisation:
    """What a run gets when the budget buys up to `passes` passes over the corpus."""

    passes: float
    dropout: float
    weight_decay: float
    ema: float


# Below about 8 passes the small model is still far from memorising its text (its held-out loss still
# falls at the end of the run): dropout would only slow it, and a weight average would lag behind it. The
# row ends at 10 because a run makes about 10% fewer steps than its timed probe foretells (checks, saves).
# Weight decay 1.0 (with ReLU squared) wins from about 4 passes on, and loses on a text read only twice
# (Kim et al. 2025 find the best weight decay grows with the passes over the data too).
REGULARISATION = (
    Regularisation(passes=4, dropout=0.0, weight_decay=0.1, ema=0.0),
    Regularisation(passes=10, dropout=0.0, weight_decay=1.0, ema=0.0),
    Regularisation(passes=15, dropout=0.1, weight_decay=1.0, ema=0.99),
    Regularisation(passes=30, dropout=0.2, weight_decay=1.0, ema=0.995),
    Regularisation(passes=math.inf, dropout=0.3, weight_decay=1.0, ema=0.995),
)


@dataclass
class Recipe:
    """What the recipe chose, and what it chose it from (training.json records both)."""

    preset: str
    dtype: str
    activation: str
    optimizer: str
    dropout: float
    weight_decay: float
    ema: float
    lr: float
    warmup_steps: int
    eval_interval: int
    eval_windows: int
    keep_best: bool
    patience: int
    max_time: float | None
    train_tokens: int
    tokens_per_s: float | None  # measured for the chosen size and dtype, checks included (None: steps only)
    steps: int  # expected within the budget
    passes: float  # over the training tokens, expected within the budget

    def describe(self, corpus_chars: int) -> str:
        """One line: what was chosen and why."""
        budget = f"{_duration(self.max_time)} on this machine" if self.max_time else f"{self.steps:,} steps"
        speed = f" at {self.tokens_per_s:,.0f} tok/s" if self.tokens_per_s else ""
        average = f"EMA {self.ema}" if self.ema else "no weight average"
        return (
            f"recipe: {_size(corpus_chars)}, {self.train_tokens:,} tokens, {budget}{speed} = "
            f"~{self.steps:,} steps, ~{self.passes:.1f} passes: preset {self.preset} "
            f"({self.dtype}, {self.activation}, {self.optimizer}), "
            f"dropout {self.dropout}, weight decay {self.weight_decay}, {average}, lr {self.lr:g}, "
            f"stops {self.patience} checks after its best"
        )

    def to_dict(self) -> dict:
        return asdict(self)


def tokens_per_step(preset: str) -> int:
    sizes = PRESETS[preset]
    return sizes["batch_size"] * sizes["context_length"]


def parameters(preset: str, vocab_size: int) -> int:
    return AFTConfig.from_preset(preset, vocab_size).approximate_parameters()


def choose(
    train_tokens: int,
    vocab_size: int,
    max_time: float | None,
    max_steps: int | None,
    speed: Callable[[str], float],
    presets: tuple[str, ...] = CANDIDATES,
    dtype: str = "fp32",
    step_tokens: Callable[[str], int] = tokens_per_step,
    checks: int = CHECKS_PER_RUN,
) -> Recipe:
    """The recipe for `train_tokens` of training text within the budget.

    `speed(preset)` measures tokens/s of a preset on this machine (smallest preset first, and not
    beyond the first that is too slow; not at all for one preset and a budget in steps). `presets`
    are the sizes to choose among (one, when the user named it); `step_tokens(preset)` the tokens of
    one of its steps (its batch and context length, or the user's); `checks` the held-out checks spread
    over the steps (the probe's, for a short time budget: fewer).
    """
    if max_time is None and max_steps is None:
        max_time = DEFAULT_BUDGET
    # A budget in steps alone still compares sizes by time: a larger one must be trained enough within
    # the default budget's time, so that --max-steps on a slow machine does not choose a size it cannot afford.
    within = max_time if max_time is not None else DEFAULT_BUDGET

    def worth_it(preset: str, tokens_per_s: float | None) -> bool:
        per_step = step_tokens(preset)
        return _worth_it(preset, _steps(per_step, within, max_steps, tokens_per_s), per_step, train_tokens, vocab_size)

    chosen, rate = presets[0], None
    for index, preset in enumerate(presets):
        if index and not worth_it(preset, rate):
            break  # not trained enough even at the smaller size's speed: no need to measure it
        measured = speed(preset) if max_time is not None or len(presets) > 1 else None
        if index and not worth_it(preset, measured):
            break
        chosen, rate = preset, measured
    steps = _steps(step_tokens(chosen), max_time, max_steps, rate)
    passes = steps * step_tokens(chosen) / max(train_tokens, 1)
    regularisation = next(row for row in REGULARISATION if passes <= row.passes)
    warmup = round(min(MAX_WARMUP, max(MIN_WARMUP, WARMUP_FRACTION * steps)))
    return Recipe(
        preset=chosen,
        dtype=dtype,
        activation=ACTIVATION,
        optimizer=OPTIMIZER,
        dropout=regularisation.dropout,
        weight_decay=regularisation.weight_decay,
        ema=regularisation.ema,
        lr=LEARNING_RATES[chosen],
        warmup_steps=min(warmup, max(steps // 10, 1)),
        eval_interval=_round(steps / checks),
        eval_windows=EVAL_WINDOWS,
        keep_best=True,
        patience=PATIENCE,
        max_time=max_time,
        train_tokens=train_tokens,
        tokens_per_s=rate,
        steps=steps,
        passes=round(passes, 2),
    )


def _steps(per_step: int, max_time: float | None, max_steps: int | None, tokens_per_s: float | None) -> int:
    """Steps of `per_step` tokens made within the budget (the first of the two limits to run out)."""
    by_time = math.inf if max_time is None else max_time * tokens_per_s / per_step
    return int(min(by_time, max_steps or math.inf))


def _worth_it(preset: str, steps: int, per_step: int, train_tokens: int, vocab_size: int) -> bool:
    """Whether a larger preset has the text to learn from, and is trained enough within the budget, to beat
    the smaller one."""
    size = parameters(preset, vocab_size)
    seen = steps * per_step
    enough = min(ENOUGH_PASSES * train_tokens, ENOUGH_TOKENS_PER_PARAMETER * size)
    return train_tokens >= MIN_TOKENS_PER_PARAMETER * size and steps >= MIN_STEPS and seen >= enough


def _round(value: float) -> int:
    """`value` to two significant figures (140, 1,500): round step numbers in the log, and from 10 on at most
    5% from `value` (below it, the nearest whole number). Patience counts checks, so a coarser rounding (1, 2
    or 5 times a power of ten) let the probe's noise halve or double how long a run waits for a better one
    (100 or 200 steps for the same budget)."""
    if value < 1:
        return 1
    power = 10 ** max(0, math.floor(math.log10(value)) - 1)
    return int(round(value / power) * power)


def _duration(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"


def _size(chars: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if chars >= scale:
            return f"{chars / scale:.1f} {unit}"
    return f"{chars} characters"


def fastest_of(candidates: Sequence[Candidate], speed: Callable[[Candidate], float]) -> dict[Candidate, float]:
    """Each candidate's best `speed` over ROUNDS rounds, timed in turn, the order reversed each round (so that none
    is always timed first, nor always right after another)."""
    speeds = dict.fromkeys(candidates, 0.0)
    for turn in range(ROUNDS):
        for candidate in candidates[:: -1 if turn % 2 else 1]:
            speeds[candidate] = max(speeds[candidate], speed(candidate))
    return speeds
