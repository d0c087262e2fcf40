"""Choosing each row's next token: the controls' filters applied to a batch's rows, each with its own values,
then one draw a row from its own generator (choose, draw); a row whose scores are not finite is refused."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aftgen.errors import AftgenError
from aftgen.generation.context import recent_tokens
from aftgen.generation.controls import CONTROLS, GREEDY_BELOW, SamplingOptions


def filter_logits(logits: torch.Tensor, options: SamplingOptions | Sequence[SamplingOptions]) -> torch.Tensor:
    """The filters that read no history (temperature, top-k, top-p, min-p) in turn, each row with its own
    options (one for all the rows, or one per row): tokens ruled out get -inf. logits: (B, V)."""
    rows = _per_row(options, logits.shape[0])
    return _filtered(logits, rows, [name for name, control in CONTROLS.items() if control.history is None])


def _per_row(given: object, count: int) -> list:
    """One per row: `given` for every row, or `given` itself where it already is a sequence."""
    return list(given) if isinstance(given, Sequence) else [given] * count


def _filtered(
    logits: torch.Tensor, rows: list[SamplingOptions], names: list[str], history: Sequence[torch.Tensor] = ()
) -> torch.Tensor:
    """The named controls' filters in turn, each row with its own value; one whose rows are all at its
    neutral value is skipped."""
    for name in names:
        control = CONTROLS[name]
        values = [getattr(row, name) for row in rows]
        if control.filter is None or (control.neutral is not None and all(v == control.neutral for v in values)):
            continue
        column = torch.tensor([[float(value)] for value in values], device=logits.device)
        if control.history is None:
            logits = control.filter(logits, column)
        else:
            lengths = [int(getattr(row, control.history)) for row in rows]
            logits = control.filter(logits, column, recent_tokens(history, lengths, logits.shape[-1], logits.device))
    return logits


class ScoresNotFinite(AftgenError):
    """Some rows' logits are NaN or +inf (or all -inf): no token can be drawn from them. `rows`: which."""

    def __init__(self, rows: list[int]):
        super().__init__(
            "the model's scores for the next token are NaN or infinite, so no token can be drawn: its weights "
            "or the state it continues are damaged (use another checkpoint or state file)"
        )
        self.rows = rows


def choose(
    logits: torch.Tensor,
    options: SamplingOptions | Sequence[SamplingOptions],
    history: Sequence[torch.Tensor],
    generator: torch.Generator | Sequence[torch.Generator],
) -> torch.Tensor:
    """The next token for each row of logits (B, V), every row in one pass with its own options and its own
    recent ids (`history`: a (B, n) tensor, or one tensor of ids per row, oldest first).

    `options` and `generator`: one for all the rows, or one per row. Each row draws from its generator
    exactly what it would draw alone, so a server's sequence follows its own seed whatever runs beside it;
    a greedy row draws nothing. Raises ScoresNotFinite, naming the rows, before any generator draws.
    """
    count = logits.shape[0]
    rows, generators = _per_row(options, count), _per_row(generator, count)
    reading = [name for name, control in CONTROLS.items() if control.history is not None]
    scores = _filtered(logits.float(), rows, reading, history)
    unusable = ~torch.isfinite(scores.amax(-1))  # the top is NaN if any is, +inf if any is, -inf if all are
    if unusable.any():
        raise ScoresNotFinite(unusable.nonzero()[:, 0].tolist())
    greedy = [row.temperature < GREEDY_BELOW for row in rows]
    if all(greedy):
        return scores.argmax(-1)
    probs = filter_logits(scores, rows).softmax(-1)
    drawn = draw(probs, [None if g else generator for g, generator in zip(greedy, generators, strict=True)])
    if any(greedy):
        drawn = torch.where(torch.tensor(greedy, device=drawn.device), scores.argmax(-1), drawn)
    return drawn


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs (B, V): the first whose cumulative probability passes u * total, with u
    uniform in [0, 1) from the row's generator (None: the row draws nothing, and its token means nothing).

    One number a row a token, and one pass for all the rows (llama.cpp draws the same way). The sums run
    along each row alone, in float64, so a row draws the same beside any others. The generators are CPU
    ones, whatever the device: a seed then draws the same on any.
    """
    uniform = torch.zeros(probs.shape[0], 1, dtype=torch.float64)
    for row, generator in zip(uniform, generators, strict=True):
        if generator is not None:
            row.uniform_(generator=generator)
    cumulative = probs.double().cumsum(-1)
    total = cumulative[:, -1:].contiguous()
    # u * total rounds to total for the largest u: the last token with any probability then
    last = torch.searchsorted(cumulative, total)
    return torch.searchsorted(cumulative, uniform.to(probs.device) * total, right=True).minimum(last)[:, 0]


def new_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    if seed is None:
        generator.seed()  # nondeterministic
    else:
        generator.manual_seed(seed)
    return generator
