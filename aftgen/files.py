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

_TEMPORARY = ".tmp"  # a file being written is ".<name>.<random>.tmp" beside its final place


@contextlib.contextmanager
def atomic_open(path: Path | str, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside `path`; on success it is fsynced and renamed over `path`."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=_TEMPORARY)
    except OSError as exc:
        raise _write_error(path, exc) from None
    try:
        with os.fdopen(fd, mode) as handle:
            yield handle
            handle.flush()
            os.fchmod(handle.fileno(), _mode_for(path))  # mkstemp's 0600 would hide the file from others
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise _write_error(path, exc) from None
        raise


def _mode_for(path: Path) -> int:
    """The permissions a plain open() would give: the replaced file's, else 0666 less the umask."""
    with contextlib.suppress(OSError):
        return path.stat().st_mode & 0o7777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _write_error(path: Path, exc: OSError) -> AftgenError:
    """Full disk, quota, permissions, read-only file system: say which file, and that nothing was lost."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return AftgenError(f"disk full while writing {path}; the previous version is intact: free some space and retry")
    return AftgenError(f"cannot write {path} ({exc.strerror or exc}); the previous version is intact")


def prepare_folder(folder: Path | str) -> None:
    """Create `folder`, refusing one that cannot be written (before hours of work, not after), and
    delete the half-written temporary files a killed process left there (never a real file)."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AftgenError(f"cannot create folder {folder} ({exc.strerror or exc})") from None
    if not os.access(folder, os.W_OK):
        raise AftgenError(f"{folder}: folder is not writable")
    for stale in folder.glob(f".*{_TEMPORARY}"):
        with contextlib.suppress(OSError):
            stale.unlink()


def atomic_write(path: Path | str, data: bytes | str) -> None:
    """Write bytes or text to `path` atomically."""
    with atomic_open(path, "wb") as handle:
        handle.write(data.encode("utf-8") if isinstance(data, str) else data)
