"""Atomic file writes: a crash at any moment leaves the old complete file or the new one, never half."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from aftgen.errors import AftgenError


@contextlib.contextmanager
def atomic_open(path: Path | str, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside `path`; on success it is fsynced and renamed over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise AftgenError(f"disk full while writing {path}; the previous version is intact") from None
        raise


def atomic_write(path: Path | str, data: bytes | str) -> None:
    """Write bytes or text to `path` atomically."""
    with atomic_open(path, "wb") as handle:
        handle.write(data.encode("utf-8") if isinstance(data, str) else data)
