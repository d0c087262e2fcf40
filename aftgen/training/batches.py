"""Training batches: random windows of a corpus's token ids, the same global batch whatever the processes."""

from __future__ import annotations

import torch

from aftgen.corpus.token_file import TokenFile


def batch(
    ids: torch.Tensor | TokenFile,
    batch_size: int,
    length: int,
    generator: torch.Generator,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of `length` + 1 tokens: inputs and next-token targets, (B, length) each.

    With several processes, each draws the same global batch of world_size x B windows and keeps
    its own B rows, so the processes together see exactly what one process with the global batch sees.
    """
    starts = torch.randint(0, len(ids) - length - 1, (batch_size * world_size,), generator=generator)
    mine = starts[rank * batch_size : (rank + 1) * batch_size]
    rows = torch.stack([ids[s : s + length + 1] for s in mine.tolist()]).long()
    if isinstance(ids, TokenFile) and ids.large:
        ids.release()  # the rows are copies (nanoGPT maps its token file afresh for each batch for the same reason)
    return rows[:, :-1], rows[:, 1:]
