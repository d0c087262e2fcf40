"""A prepared corpus's token ids on disk, memory-mapped for training to read (cache.py writes them)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch

from aftgen.errors import AftgenError
from aftgen.files import open_regular

# Token files above this size have their pages unmapped after each batch; smaller ones may stay mapped whole.
RELEASE_ABOVE = 64 << 20


class TokenFile:
    """Token ids in a file, memory-mapped: ids[a:b] reads them from the page cache, and `release` unmaps the
    pages read so far, so that resident memory stays flat however many batches are drawn. (The kernel maps
    whole folios of up to 2 MB around each window read: 80 MB for 10 batches of a 1 GB corpus if kept.)"""

    def __init__(self, path: Path | str, dtype: torch.dtype, count: int):
        size = count * dtype.itemsize
        with open_regular(path, size, "token file") as handle:
            if os.fstat(handle.fileno()).st_size != size:
                raise AftgenError(
                    f"{path}: token file is not the {size:,} bytes recorded; delete it to prepare it again"
                )
            # private and writable, so torch shares it without a copy or a warning
            self._map = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY)
        self.ids = torch.frombuffer(self._map, dtype=dtype)
        self.large = len(self._map) > RELEASE_ABOVE

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index) -> torch.Tensor:
        return self.ids[index]

    def release(self) -> None:
        if hasattr(self._map, "madvise"):
            self._map.madvise(mmap.MADV_DONTNEED)  # unchanged private pages: dropped, read again when next used
