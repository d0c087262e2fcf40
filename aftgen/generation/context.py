"""Where a generation stands (Context): the model's state, the next token's scores, the generator and the
recent ids the repeat penalty reads, and those ids as the filters read them (Histories, recent_tokens)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from aftgen.model import ModelState, clone_state

MAX_REPEAT_LAST_N = 1024  # a context keeps this many recent tokens for the repeat penalty, so its size is fixed


@dataclass
class Context:
    """Where a generation stands: enough to continue it exactly, and nothing that grows with its length."""

    state: ModelState
    logits: torch.Tensor  # (1, vocab): scores for the next token
    generator: torch.Generator
    recent: torch.Tensor = field(
        default_factory=lambda: torch.zeros(1, 0, dtype=torch.long)
    )  # last ids, for the repeat penalty (read them through history(): the newest may wait in `arrived`)
    pending: bytes = b""  # the start of a character the last token left unfinished
    arrived: list[int] = field(default_factory=list)  # ids remembered since `recent` was last brought up to date

    def remember(self, ids: Sequence[int]) -> None:
        # A list append per token: the tensor is made only where it is read (a repeat penalty, a state file).
        self.arrived.extend(ids)
        if len(self.arrived) >= MAX_REPEAT_LAST_N:
            self.history()

    def history(self) -> torch.Tensor:
        """The last MAX_REPEAT_LAST_N ids at most, (1, n), oldest first."""
        if self.arrived:
            arrived = torch.tensor([self.arrived], dtype=torch.long)
            self.recent, self.arrived = torch.cat([self.recent, arrived], dim=1)[:, -MAX_REPEAT_LAST_N:], []
        return self.recent

    def fork(self, generator: torch.Generator | None = None) -> Context:
        """An independent copy drawing from `generator`, or sharing this one's (so forks draw different samples)."""
        generator = generator or self.generator
        return Context(clone_state(self.state), self.logits.clone(), generator, self.history().clone(), self.pending)


class Histories(Sequence):
    """Each context's recent ids, (1, n) each, made only where a filter reads them (Context.history)."""

    def __init__(self, contexts: Sequence[Context]):
        self.contexts = contexts

    def __len__(self) -> int:
        return len(self.contexts)

    def __getitem__(self, row: int) -> torch.Tensor:
        return self.contexts[row].history()


def recent_tokens(
    history: Sequence[torch.Tensor], lengths: list[int], vocab: int, device: torch.device
) -> torch.Tensor:
    """(B, vocab): True where a token is among its row's last `lengths[row]` ids (history: a tensor of ids a row)."""
    recent = torch.zeros(len(lengths), vocab, dtype=torch.bool)
    for row, ids, length in zip(recent, history, lengths, strict=True):
        if length:
            row[ids.reshape(-1)[-length:]] = True
    return recent.to(device)
