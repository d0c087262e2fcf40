"""Many sequences' recurrent states stacked along the batch, so one `model.step` advances them all.

Every AFT state has the same shape whatever its history, so rows stack as they are: a layer's window is a
ring buffer (a row's token g sits in slot g mod s), and each row keeps its own `position`, the tokens it has
read, so sequences of any lengths step together, each at its own phase of its ring (aftgen.mixers.aft),
and a row's state joins and leaves the batch as it is. The step itself is the library's.

Batch-invariant (`--batch-invariant`, the default for a compiled step on a CPU), a row's logits are what it
would get alone, whatever the rows beside it: the compiled step is made so (aftgen.model, aftgen.native),
and the eager step, whose matrix kernels round differently with the number of rows, steps each row on its
own (`rows_apart`).

The rows live in buffers allocated once for `capacity` sequences: joining copies one row in, leaving
moves the last row into the gap. Nothing is reallocated as requests come and go, so memory holds
still however busy the server gets.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable

import torch

from aftgen.compiled.step import compile_step
from aftgen.device import Placement
from aftgen.layers import Invariance, judged
from aftgen.mixers import fixed_size_state
from aftgen.model import AFTLM, ModelState, StepFunction, tokens_read

# Seconds a starting server waits for its compiled step before it listens. A first compile of a new model can
# take longer on two cores: the server then listens, /health answers 503 and requests wait until it is done.
COMPILE_WAIT = 40.0
COMPILING, COMPILED, EAGER = "compiling", "compiled", "eager"  # what /health says of the step (step_figures)
KERNELS_STEP = Invariance(False)  # a step not asked to be batch-invariant: the matrix kernels'


class Batch:
    """The states of the sequences now generating, one row each, stepped together.

    `rows[r]` is whatever the caller gave for row r (the engine's sequences).
    """

    def __init__(self, model: AFTLM, capacity: int, step: StepFunction | None = None):
        """`step`: how the rows are stepped, `model.step` or a compiled form of it (CompiledBatchStep)."""
        if not fixed_size_state(model.config.mixer):
            raise ValueError(f"a {model.config.mixer} mixer has no fixed-size state to batch")
        self.model, self.capacity, self.run_step = model, capacity, step or model.step
        # Untouched memory: pages become resident only as rows are first used.
        self.buffers = [
            {name: t.new_empty((capacity, *t.shape[1:])) for name, t in layer.items()}
            for layer in model.initial_state(1)
        ]
        self.rows: list[object] = []
        self.stepped: ModelState | None = None  # what the step is handed: views of the rows, while they stay
        self.logits: torch.Tensor | None = None  # the last step's (B, vocab), while the rows stay as they were

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, joining: list[tuple[object, ModelState]]) -> None:
        """Append rows: (owner, batch-1 state) each."""
        for owner, state in joining:
            if len(self.rows) == self.capacity:
                raise ValueError(f"the batch holds {self.capacity} rows at most")
            row = len(self.rows)
            for buffers, layer in zip(self.buffers, state, strict=True):
                for name, buffer in buffers.items():
                    buffer[row].copy_(layer[name][0])
            self.rows.append(owner)
            self.stepped = self.logits = None

    def state_of(self, owner: object) -> tuple[ModelState, int]:
        """A copy of one row's state as a batch-1 state, and the tokens it has read."""
        row = self.rows.index(owner)
        single = [{name: buffer[row : row + 1].clone() for name, buffer in layer.items()} for layer in self.buffers]
        return single, tokens_read(single)

    def remove(self, owners: list[object]) -> None:
        """Take these rows out: the last rows staying move into the gaps below, all in one copy per state tensor."""
        leaving = {self.rows.index(owner) for owner in owners}
        if not leaving:
            return
        kept = len(self.rows) - len(leaving)
        gaps = sorted(row for row in leaving if row < kept)
        movers = [row for row in range(kept, len(self.rows)) if row not in leaving]  # as many as the gaps
        if gaps:
            to, source = (torch.tensor(rows, device=self.model.embed.weight.device) for rows in (gaps, movers))
            for layer in self.buffers:
                for buffer in layer.values():
                    buffer[to] = buffer[source]
            for gap, mover in zip(gaps, movers, strict=True):
                self.rows[gap] = self.rows[mover]
        del self.rows[kept:]
        self.stepped = self.logits = None

    def clear(self) -> None:
        self.rows, self.stepped, self.logits = [], None, None

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (in `rows` order), tokens (B,); returns logits (B, vocab)."""
        if self.stepped is None:  # the rows changed: views of them, which the step updates in place
            count = len(self.rows)
            self.stepped = [{name: buffer[:count] for name, buffer in layer.items()} for layer in self.buffers]
        self.logits, _ = self.run_step(tokens, self.stepped)
        return self.logits


def eager_step(model: AFTLM, batch_invariant: bool) -> StepFunction:
    """The step a batch runs without a compiled one: `model.step`, or each row apart where a row's logits
    must not depend on the rows beside it."""
    return rows_apart(model.step) if batch_invariant else model.step


def rows_apart(step: StepFunction) -> StepFunction:
    """`step` for a batch as each row's own batch-1 step, one after another: each row's logits are then exactly
    those it gets alone. Slower than one step of them all: for the eager step, whose matrix kernels round a
    row differently with the number of rows."""

    def each_row(ids: torch.Tensor, state: ModelState) -> tuple[torch.Tensor, ModelState]:
        logits = []
        for row in range(ids.shape[0]):  # views of the row, updated in place
            own = [{name: t[row : row + 1] for name, t in layer.items()} for layer in state]
            logits.append(step(ids[row : row + 1], own)[0])
        return torch.cat(logits), state

    return each_row


class CompiledBatchStep:
    """The model's step compiled for 1 to `rows` rows (compiled.step.compile_step) under `placement`, as the batch runs
    it; the eager step (`eager_step`) where compiling fails (one line on stderr says why). `invariance`
    (aftgen.layers.batch_invariant): whether its rows do not depend on each other (compile_step); where that is
    only the default, the step compiled is timed against the matrix kernels' one and kept unless over a tenth
    slower (`timed_steps`). The decision stays as `batch_invariant`, and where it is off, why, in one line, as
    `batch_invariant_reason`.

    Made when a server starts, before it listens: it waits `wait` seconds at most for the compile (a second
    start loads it from the cache in about a second). `ready` is set once the step that serves is settled,
    compiled or eager after a failure, and `on_ready` called: the engine admits nothing before, since the eager
    step's text rounds otherwise than the compiled step's that would follow it.
    """

    def __init__(
        self,
        model: AFTLM,
        rows: int,
        placement: Placement,
        wait: float = COMPILE_WAIT,
        invariance: Invariance = KERNELS_STEP,
    ):
        self.model, self.invariance = model, invariance
        self.batch_invariant, self.batch_invariant_reason = invariance.on, invariance.reason
        self.step = eager_step(model, self.batch_invariant)
        self.ready, self.on_ready = threading.Event(), lambda: None
        self.fallback: str | None = None  # why the step is eager, where the compile failed
        compiling = threading.Thread(target=self._compile, args=(rows, placement), name="aftgen-compile", daemon=True)
        compiling.start()
        compiling.join(wait)
        if compiling.is_alive():
            say(f"the batched step is still compiling after {wait:g} s: requests wait until it is done")

    def _compile(self, rows: int, placement: Placement) -> None:
        with placement.autocast():  # the compiled step is specific to the autocast it runs under
            step, note = compile_step(self.model, rows, self.batch_invariant)
            if step != self.model.step and self.invariance.by_default:
                step = self._timed(step, rows)
        if step == self.model.step:  # bound methods: equal, never the same object; compile_step said why
            self.fallback = note
        else:
            self.step = step
        self.ready.set()
        self.on_ready()

    def figures(self) -> dict:
        """What /health says of the step: compiling, compiled or eager (and then why), batch-invariant or not
        (and where not, why)."""
        figures = {"step": COMPILING, "batch_invariant": self.batch_invariant}
        if self.ready.is_set():
            figures["step"] = COMPILED if self.fallback is None else EAGER
        if self.fallback is not None:
            figures["step_note"] = self.fallback
        if self.batch_invariant_reason is not None:
            figures["batch_invariant_note"] = self.batch_invariant_reason
        return figures

    def _timed(self, invariant: StepFunction, rows: int) -> StepFunction:
        """The batch-invariant step, unless timed here over a tenth slower than the matrix kernels' (compiled
        too, or loaded from the cache): then that one, the decision and its reason kept."""
        kernels, _ = compile_step(self.model, rows, batch_invariant=False)
        if kernels == self.model.step:  # nothing compiled to compare with
            return invariant
        decided = judged(timed_steps(self.model, invariant, kernels, rows))
        self.batch_invariant, self.batch_invariant_reason = decided.on, decided.reason
        return invariant if decided.on else kernels

    def __call__(self, ids: torch.Tensor, state: ModelState) -> tuple[torch.Tensor, ModelState]:
        return self.step(ids, state)


TIMED_ROWS = 32  # the batch a step is timed at besides one row: aftgen serve's default --parallel
TIMED_CALLS = 5  # calls of a step a timing takes (the best of aftgen.training.recipe.fastest_of's rounds)


@torch.inference_mode()
def timed_steps(model: AFTLM, invariant: StepFunction, kernels: StepFunction, rows: int) -> dict[int, tuple]:
    """At 1 row and at min(`rows`, TIMED_ROWS): the seconds a call of each step takes (invariant's, kernels'),
    from initial states, the best of a few calls timed in turn: a few dozen steps in all."""
    from aftgen.training.recipe import fastest_of

    times = {}
    for count in sorted({1, min(rows, TIMED_ROWS)}):
        ids = torch.zeros(count, dtype=torch.long, device=model.embed.weight.device)
        calls = {step: functools.partial(step, ids, model.initial_state(count)) for step in (invariant, kernels)}
        for call in calls.values():  # the first call of a package pages it in
            call()
        speeds = fastest_of(list(calls), lambda step, calls=calls: TIMED_CALLS / _seconds(calls[step]))
        times[count] = (1 / speeds[invariant], 1 / speeds[kernels])
    return times


def _seconds(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    for _ in range(TIMED_CALLS):
        call()
    return time.perf_counter() - start


def say(line: str) -> None:
    print(f"aftgen serve: {line}", file=sys.stderr, flush=True)
