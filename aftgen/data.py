"""Where prepared data is cached, and training batches drawn from token ids (aftgen/corpus/ prepares them)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch


def cache_dir() -> Path:
    """Where tokenizers and token ids are cached: $AFTGEN_CACHE, else $XDG_CACHE_HOME/aftgen."""
    if os.environ.get("AFTGEN_CACHE"):
        return Path(os.environ["AFTGEN_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "aftgen"


# Token files above this size have their pages unmapped after each batch; smaller ones may stay mapped whole.
RELEASE_ABOVE = 64 << 20


class TokenFile:
    """Token ids in a file, memory-mapped: ids[a:b] reads them from the page cache, and `release` unmaps the
    pages read so far, so that resident memory stays flat however many batches are drawn. (The kernel maps
    whole folios of up to 2 MB around each window read: 80 MB for 10 batches of a 1 GB corpus if kept.)"""

    def __init__(self, path: Path | str, dtype: torch.dtype, count: int):
        with open(path, "rb") as handle:  # private and writable, so torch shares it without a copy or a warning
            self._map = mmap.mmap(handle.fileno(), count * dtype.itemsize, access=mmap.ACCESS_COPY)
        self.ids = torch.frombuffer(self._map, dtype=dtype)
        self.large = len(self._map) > RELEASE_ABOVE

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index) -> torch.Tensor:
        return self.ids[index]

    def release(self) -> None:
        if hasattr(self._map, "madvise"):
            self._map.madvise(mmap.MADV_DONTNEED)  # unchanged private pages: dropped, read again when next used


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
