"""The sampling controls (CONTROLS): each one's default, range, help and filter, and SamplingOptions, which
holds a value for each, beside the options of a generation that are not filters (tokens, seed, stops)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from aftgen.constraints import Constraint
from aftgen.errors import AftgenError
from aftgen.generation.context import MAX_REPEAT_LAST_N
from aftgen.options import Range, flag

# Below this temperature sampling is greedy: a lower one only splits logits closer than a thousandth, and
# dividing by it overflows float32 long before it reaches Python's smallest floats.
GREEDY_BELOW = 1e-4


SEEDS = Range(0, (1 << 63) - 1)  # a seed torch.Generator.manual_seed takes as it is given

Filter = Callable[..., torch.Tensor]  # (B, V) logits, each row's value (B, 1)[, its recent tokens (B, V)] -> logits


@dataclass(frozen=True)
class Control:
    """A sampling control: its default (whose type is the control's), range and help, and its filter.

    `aftgen sample` and `aftgen chat` take each one in CONTROLS as an option, the server as a request
    field, SamplingOptions as a field of its own. The engine draws every row of its batch in one pass, so a filter
    takes the logits (B, V) and each row's value (B, 1), and returns logits (tokens ruled out: -inf).
    """

    default: float
    range: Range
    help: str
    filter: Filter | None = None  # None: a setting another control's filter reads (see `history`)
    # A value at which the filter leaves a row exactly as it is: a batch whose rows all have it skips the
    # filter, and a row that has it is filtered beside the others unchanged (None: the filter always runs).
    neutral: float | None = None
    # The control that says how many of a row's recent tokens this filter reads: the filter then takes a
    # third argument, (B, V) True where the token is among them. Such filters run first, on the model's
    # scores, and a greedy row picks from what they leave.
    history: str | None = None

    @property
    def type(self) -> type:
        return type(self.default)


def divide_by_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    # Less the top logit first (softmax does not mind): a small temperature then sends the others to -inf,
    # never to +inf. A greedy row (below GREEDY_BELOW) is divided too, beside the others, but by
    # GREEDY_BELOW: choose() takes its argmax, and its scores here only must not overflow.
    logits = logits.float()
    return (logits - logits.amax(-1, keepdim=True)) / temperature.clamp(min=GREEDY_BELOW)


def keep_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    top_k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # 0: off
    order = logits.argsort(dim=-1, descending=True, stable=True)  # exactly k, ties to the lower id
    drop_sorted = torch.arange(vocab, device=logits.device) >= top_k
    return logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


def keep_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1, stable=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    # Keep the smallest set whose probability reaches top_p: a token goes if the ones before it already do.
    # The likeliest always stays, even for a top_p that float32 rounds to 0; at 1 every token stays, even
    # where the sum before the last rounds up to 1.
    before = torch.cat([torch.full_like(cumulative[..., :1], -1.0), cumulative[..., :-1]], dim=-1)
    drop_sorted = (before >= top_p) & (top_p < 1.0)
    return logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


def keep_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))


def apply_repeat_penalty(logits: torch.Tensor, penalty: torch.Tensor, recent: torch.Tensor) -> torch.Tensor:
    """CTRL's penalty, as llama.cpp applies it: divide positive logits of recent tokens, multiply negative ones.
    recent: (B, V) True where the token is among the row's recent ones (each counted once)."""
    return torch.where(recent, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


# Every sampling control, by name; the filters run in this order (temperature first), those that read a
# row's history before the others.
CONTROLS: dict[str, Control] = {
    "temperature": Control(0.8, Range(0, 2), f"0 (or below {GREEDY_BELOW:g}): greedy.", divide_by_temperature),
    "top_k": Control(0, Range(0), "Keep the k likeliest tokens (0: off).", keep_top_k, neutral=0),
    "top_p": Control(1.0, Range(0, 1, open_low=True), "Keep the smallest set reaching p.", keep_top_p, neutral=1.0),
    "min_p": Control(
        0.0, Range(0, 1, open_high=True), "Drop tokens below min_p x the top probability.", keep_min_p, neutral=0.0
    ),
    "repeat_penalty": Control(  # 1e-4 already makes a recent token all but certain; below, logits only overflow
        1.0,
        Range(1e-4, 100),
        "Divide recent tokens' positive logits by this (1: off).",
        apply_repeat_penalty,
        neutral=1.0,
        history="repeat_last_n",
    ),
    "repeat_last_n": Control(64, Range(0, MAX_REPEAT_LAST_N), "How many recent tokens the penalty covers."),
}
# Where the HTTP API's default differs from the command line's: the server speaks OpenAI's API, whose clients
# expect OpenAI's defaults (temperature 1), while `aftgen sample` and `chat` keep llama.cpp's (0.8).
API_DEFAULTS = {"temperature": 1.0}


def check_seed(seed: int | None) -> None:
    """Refuse a seed outside SEEDS (None: a random one)."""
    if seed is not None and seed not in SEEDS:
        raise AftgenError(f"--seed must be {SEEDS}, got {seed}")


@dataclass
class SamplingOptions:
    """How to pick tokens (llama.cpp / transformers names and meanings), and how many continuations.

    Each control in CONTROLS is a field of the same name, type and default (tests/generation/test_controls.py
    holds the two together): a control added to CONTROLS gets its field here too.
    """

    max_new_tokens: int = 200  # -1: until stopped
    seed: int | None = None
    stop: tuple[str, ...] = ()
    num_samples: int = 1  # continuations of one prompt
    temperature: float = CONTROLS["temperature"].default
    top_k: int = CONTROLS["top_k"].default
    top_p: float = CONTROLS["top_p"].default
    min_p: float = CONTROLS["min_p"].default
    repeat_penalty: float = CONTROLS["repeat_penalty"].default
    repeat_last_n: int = CONTROLS["repeat_last_n"].default
    constraint: Constraint | None = None  # what the text must be: a JSON schema, a regex, ... (aftgen.constraints)

    def check(self) -> None:
        """Refuse values outside their meaning, before any work."""
        if self.max_new_tokens < -1:
            raise AftgenError(f"--max-new-tokens must be -1 (no limit) or >= 0, got {self.max_new_tokens}")
        check_seed(self.seed)
        for name, control in CONTROLS.items():
            if getattr(self, name) not in control.range:
                raise AftgenError(f"{flag(name)} must be {control.range}, got {getattr(self, name)}")
        if self.num_samples < 1:
            raise AftgenError(f"--num-samples must be >= 1, got {self.num_samples}")
        if any(not s for s in self.stop):
            raise AftgenError("--stop strings must not be empty")
