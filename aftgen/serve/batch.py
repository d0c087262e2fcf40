"""Many sequences' recurrent states stacked along the batch, so one `model.step` advances them all.

Every AFT state has the same shape whatever its history, so rows stack, except for one thing: a
layer's window is a ring buffer (token g sits in slot g mod s) addressed by a `position` that the
whole batch shares. Sequences that have read different numbers of tokens are at different phases of
their rings. Only the phase matters to the step (the prefix sums do not depend on the position), so
a joining row's window is rotated to the batch's phase, and rotated back when it leaves, with its
own position restored. The step itself is the library's, unchanged.
"""

from __future__ import annotations

import torch

from aftgen.model import AFTLM, ModelState

RING_BUFFERS = ("window_k", "window_v")  # (B, s, H, D), token g at slot g mod s (aftgen.mixer.aft_step)


def rephase(state: ModelState, from_position: int, to_position: int) -> ModelState:
    """The same state with every window rotated so that it reads as if at `to_position` (positions set too)."""
    moved = []
    for layer in state:
        layer = dict(layer)
        window = layer[RING_BUFFERS[0]].shape[1]
        if window:
            shift = (to_position - from_position) % window
            for name in RING_BUFFERS:
                layer[name] = torch.roll(layer[name], shift, dims=1)
        layer["position"] = torch.tensor(to_position, dtype=torch.long, device=layer[RING_BUFFERS[0]].device)
        moved.append(layer)
    return moved


def _stack(states: list[ModelState], position: int) -> ModelState:
    """One batched state from batch-1 states already at `position`'s phase."""
    stacked = []
    for layers in zip(*states, strict=True):
        layer = {name: torch.cat([each[name] for each in layers]) for name in layers[0] if name != "position"}
        layer["position"] = torch.tensor(position, dtype=torch.long, device=layers[0]["position"].device)
        stacked.append(layer)
    return stacked


class Batch:
    """The states of the sequences now generating, one row each, stepped together.

    `offsets[r]` is the batch position minus row r's own position: its true position is always
    `position - offsets[r]`, however many steps it takes with the batch.
    """

    def __init__(self, model: AFTLM):
        if model.config.mixer == "attention":
            raise ValueError("only AFT mixers have a fixed-size state to batch")
        self.model = model
        self.state: ModelState = []
        self.position = 0
        self.offsets: list[int] = []

    def __len__(self) -> int:
        return len(self.offsets)

    def add(self, states: list[tuple[ModelState, int]]) -> None:
        """Append rows: (batch-1 state, its position) each, in order."""
        if not states:
            return
        if not self.offsets:
            self.position = states[0][1]
        joining = [rephase(state, position, self.position) for state, position in states]
        self.state = _stack(([self.state] if self.offsets else []) + joining, self.position)
        self.offsets += [self.position - position for _, position in states]

    def remove(self, rows: list[int]) -> list[tuple[ModelState, int]]:
        """Take rows out (in the order given); returns each one's batch-1 state at its own position."""
        if not rows:
            return []
        taken = []
        for row in rows:
            own = self.position - self.offsets[row]
            single = [{name: t[row : row + 1].clone() for name, t in layer.items() if t.dim()} for layer in self.state]
            taken.append((rephase(single, self.position, own), own))
        gone = set(rows)
        kept = [row for row in range(len(self.offsets)) if row not in gone]
        self.offsets = [self.offsets[row] for row in kept]
        if kept:
            index = torch.tensor(kept, device=self.state[0]["position"].device)
            self.state = [
                {name: t.index_select(0, index) if t.dim() else t for name, t in layer.items()} for layer in self.state
            ]
        else:
            self.state = []
        return taken

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row, tokens (B,); returns logits (B, vocab)."""
        logits, self.state = self.model.step(tokens, self.state)
        self.position += 1
        return logits
