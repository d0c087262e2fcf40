"""Where prepared data is cached, and training batches drawn from token ids (aftgen/corpus/ prepares them)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def cache_dir() -> Path:
    """Where tokenizers and token ids are cached: $AFTGEN_CACHE, else $XDG_CACHE_HOME/aftgen."""
    if os.environ.get("AFTGEN_CACHE"):
        return Path(os.environ["AFTGEN_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "aftgen"


def batch(
    ids: torch.Tensor, batch_size: int, length: int, generator: torch.Generator, rank: int = 0, world_size: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of `length` + 1 tokens: inputs and next-token targets, (B, length) each.

    With several processes, each draws the same global batch of world_size x B windows and keeps
    its own B rows, so the processes together see exactly what one process with the global batch sees.
    """
    starts = torch.randint(0, len(ids) - length - 1, (batch_size * world_size,), generator=generator)
    mine = starts[rank * batch_size : (rank + 1) * batch_size]
    rows = torch.stack([ids[s : s + length + 1] for s in mine.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]
