"""The one door for every file aftgen reads or writes.

Reads (`read_bytes`, `read_text`, `read_json`, `open_regular`) take regular files only, never block on a
FIFO or device, and refuse a file larger than it can legitimately be before reading it. Writes go through
`atomic_open`: a crash at any moment leaves the old complete file or the new one, never half, and the new
file is renamed over the path (a link there is replaced, never written through). `locked_folder` keeps a
folder to one writing process at a time. `shown` makes text read from a file safe to print.

Every record aftgen reads back (a registry entry, a cache's record, a run's description) is declared once as
a typed struct (msgspec) with its defaults, and read through `read_record` (or `as_record`, for one already
parsed from another file's header): a missing field takes its default, and a field of another type (null, a
list, a string for a count, 1e30 for a PID) refuses the whole record with one line, never a traceback. An
older aftgen or another hand may have written it; the caller says what a refused record means (skipped,
made again, or an error)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import os
import stat
import tempfile
import time
import unicodedata
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, BinaryIO, TypeVar

import msgspec

from aftgen.errors import AftgenError

Record = TypeVar("Record")

_TEMPORARY = ".tmp"  # a file being written is ".<name>.<random>.tmp" beside its final place
LOCK = ".lock"  # in a folder a process writes: its PID, and an flock held for as long as it writes
_KINDS = {stat.S_IFREG: "a file", stat.S_IFDIR: "a folder", stat.S_IFCHR: "a device", stat.S_IFBLK: "a device",
          stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}  # fmt: skip


def check_output(path: Path | str) -> None:
    """Refuse to write `path` unless it is absent or a regular file (or a link to one): renaming a new file
    over a device, FIFO or socket would replace it (as root, even /dev/full) instead of writing into it."""
    kind = _kind(path)
    if kind not in (None, "a file"):
        raise AftgenError(f"{path} is {kind}, not a file: give the path of a file to write")


def _kind(path: Path | str) -> str | None:
    """What is at `path` ("a file", "a folder", "a device", ...), following links; None if nothing is (or
    it cannot be reached: the write itself then says why)."""
    try:
        return kind_of(os.stat(path).st_mode)
    except OSError:
        return None


def cache_dir() -> Path:
    """Where aftgen keeps what it can make again (tokenizers, token ids, compiled steps): $AFTGEN_CACHE,
    else $XDG_CACHE_HOME/aftgen."""
    if os.environ.get("AFTGEN_CACHE"):
        return Path(os.environ["AFTGEN_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "aftgen"


def kind_of(mode: int) -> str:
    """What a file of this st_mode is: "a file", "a folder", "a device", "a FIFO", ..."""
    return _KINDS.get(stat.S_IFMT(mode), "a special file")


def open_regular(path: Path | str, limit: int, what: str, follow: bool = True) -> BinaryIO:
    """`path` opened for reading in binary, if it is a regular file of at most `limit` bytes (a link to one
    is followed, unless not `follow`). The open itself never blocks (O_NONBLOCK: a FIFO would wait for a
    writer), and what was opened is checked, not the name, so a link swapped in between cannot smuggle in a
    device or FIFO."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY | (0 if follow else os.O_NOFOLLOW))
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise AftgenError(f"{path}: {what} is a link, which aftgen never makes; remove it") from None
        raise AftgenError(f"{path}: cannot read {what} ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise AftgenError(f"{path}: {what} is {kind_of(info.st_mode)}, not a regular file; remove or replace it")
        _check_size(path, info.st_size, limit, what)
        os.set_blocking(fd, True)  # a regular file's reads never wait; the flag would only make them fail
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _check_size(path: Path, size: int, limit: int, what: str) -> None:
    if size > limit:
        raise AftgenError(
            f"{path}: {what} is {size:,} bytes, more than it can hold ({limit:,}), so it is damaged or not what "
            "it should be; remove or replace it"
        )


def read_bytes(path: Path | str, limit: int, what: str, follow: bool = True) -> bytes:
    """The whole of a regular file of at most `limit` bytes (see `open_regular`); `what` names it in errors."""
    with open_regular(path, limit, what, follow) as handle:
        try:
            data = handle.read(limit + 1)  # limit + 1: a file that grew after the check is still refused
        except OSError as exc:
            raise AftgenError(f"{path}: cannot read {what} ({exc.strerror or exc})") from None
    _check_size(Path(path), len(data), limit, what)
    return data


SOURCE_LIMIT = 1 << 20  # one of aftgen's own source files
KERNEL_FILE_LIMIT = 1 << 16  # a /proc or /sys file aftgen reads (they report no size: read up to this)


def own_source(path: Path | str) -> bytes:
    """One of aftgen's own source files, as what a compiled step or library is keyed by is hashed from it."""
    return read_bytes(path, SOURCE_LIMIT, "aftgen's own source")


def read_text(path: Path | str, limit: int, what: str, encoding: str = "utf-8", follow: bool = True) -> str:
    """A regular file of at most `limit` bytes, decoded."""
    data = read_bytes(path, limit, what, follow)
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise AftgenError(f"{path}: {what} is not {encoding} text (byte {exc.start}); remove or replace it") from None


def read_json(path: Path | str, limit: int, what: str) -> Any:
    """A regular file of at most `limit` bytes, parsed as JSON; malformed or absurdly nested is an AftgenError."""
    data = read_bytes(path, limit, what)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:  # not UTF-8 text, malformed, a 5000-digit number, or nested past
        reason = "nested too deep" if isinstance(exc, RecursionError) else shown(exc)  # what json reads
        raise AftgenError(f"{path}: not valid JSON ({reason})") from None


def read_record(path: Path | str, kind: type[Record], limit: int, what: str) -> Record:
    """The JSON record of type `kind` in a regular file of at most `limit` bytes; a malformed one, or one whose
    fields do not fit `kind`, is an AftgenError that names the first field that does not."""
    data = read_bytes(path, limit, what)
    try:
        return msgspec.json.decode(data, type=kind, strict=True)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _not_a_record(path, what, exc) from None


def as_record(value: object, kind: type[Record], source: Path | str, what: str) -> Record:
    """`value`, parsed from the JSON in `source`, as a record of type `kind` (see `read_record`)."""
    try:
        return msgspec.convert(value, kind, strict=True)
    except (msgspec.ValidationError, RecursionError) as exc:
        raise _not_a_record(source, what, exc) from None


def _not_a_record(path: Path | str, what: str, exc: Exception) -> AftgenError:
    reason = "nested too deep" if isinstance(exc, RecursionError) else shown(exc)
    return AftgenError(f"{path}: {what} is not one aftgen can read ({reason})")


def shown(text: object, limit: int = 200) -> str:
    """Text that came from a file, fit to print: control and format characters (escape sequences, bidi
    overrides, newlines) dropped, and cut to `limit` characters (read no further: the text may be huge)."""
    kept = "".join(itertools.islice((c for c in str(text) if unicodedata.category(c)[0] != "C"), limit + 1))
    return kept if len(kept) <= limit else kept[: limit - 1] + "…"


@contextlib.contextmanager
def atomic_open(path: Path | str, mode: str = "wb", durable: bool = True) -> Iterator[IO]:
    """Open a temporary file beside `path`; on success it is renamed over `path` (a link there is
    replaced, never followed). `durable` fsyncs it first: a file that can be lost in a crash skips that."""
    path = Path(path)
    check_output(path)
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
            if durable:
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


@contextlib.contextmanager
def locked_folder(folder: Path | str, warn: Callable[[str], None]) -> Iterator[Path]:
    """Create `folder` and keep it to this process while the block runs: a second process is refused
    (naming the first's PID), a lock left by a process that died is taken over (`warn` hears of it). The
    half-written temporaries a killed writer left are deleted then, never a real file; a folder created
    here and still empty at the end (the work was refused) is removed.

    The lock is an flock on the folder's lock file, which the kernel drops however its holder ends
    (kill -9 included); the PID written in the file is for the messages, and the file goes at exit.
    """
    folder = Path(folder)
    created = _create_folder(folder)
    path = folder / LOCK
    fd = _take_lock(path, warn)
    try:
        for stale in folder.glob(f".*{_TEMPORARY}"):
            with contextlib.suppress(OSError):
                stale.unlink()
        yield folder
    finally:
        with contextlib.suppress(OSError):
            path.unlink()  # before unlocking: a process waiting on this file finds it gone and locks a new one
        if created:
            with contextlib.suppress(OSError):
                folder.rmdir()  # still empty: the work was refused before it began, and leaves nothing behind
        os.close(fd)


def _create_folder(folder: Path) -> bool:
    """Create `folder` if need be (whether it was), refusing one that cannot be written before hours of
    work, not after."""
    created = not folder.is_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise AftgenError(f"{folder} is {_kind(folder)}, not a folder: give the path of a folder to write") from None
    except OSError as exc:
        raise AftgenError(f"cannot create folder {folder} ({exc.strerror or exc})") from None
    if not os.access(folder, os.W_OK):
        raise AftgenError(f"{folder}: folder is not writable")
    return created


def _take_lock(path: Path, warn: Callable[[str], None]) -> int:
    """The lock file's descriptor, flocked, with this process's PID written in it."""
    while True:
        fd = open_lock(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holders_pid(fd)
            os.close(fd)
            raise AftgenError(
                f"{path.parent} is being written by another aftgen process{f' (PID {holder})' if holder else ''}; "
                "wait for it to end, stop it, or choose another folder"
            ) from None
        except OSError as exc:  # a file system without locks
            os.close(fd)
            raise AftgenError(f"cannot lock {path.parent} ({exc.strerror or exc})") from None
        if still_names(path, fd):
            break
        os.close(fd)  # its holder removed it as it ended, between our open and our flock: lock the new one
    if not _holds_a_pid(fd):
        os.close(fd)
        raise AftgenError(f"{path} holds something other than a PID, so aftgen did not make it: remove it and retry")
    if holder := _read_pid(fd):
        warn(f"warning: {path.parent} was locked by process {holder}, which ended without unlocking it; taking over")
    os.ftruncate(fd, 0)  # ours: it holds a PID or nothing
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


@contextlib.contextmanager
def locked_file(path: Path, wait: float | None = None, waiting: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold the lock file at `path` (see `open_lock`) while the block runs; another process waits for it: as
    long as it is held, or at most `wait` seconds (then an AftgenError), calling `waiting` once it has waited
    LOCK_NOTICE seconds. The kernel drops an flock however its holder ends."""
    fd = open_lock(path)
    try:
        if wait is None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        else:
            _lock_within(fd, path, wait, waiting or (lambda: None))
        yield
    finally:
        os.close(fd)  # which unlocks it


LOCK_NOTICE = 3.0  # seconds a bounded wait for a lock goes on before it says so


def _lock_within(fd: int, path: Path, wait: float, waiting: Callable[[], None]) -> None:
    """flock `fd` within `wait` seconds, calling `waiting` once past LOCK_NOTICE seconds."""
    start = time.monotonic()
    noticed = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            waited = time.monotonic() - start
        except OSError as exc:  # a file system without locks
            raise AftgenError(f"cannot lock {path.parent} ({exc.strerror or exc})") from None
        if waited >= wait:
            raise AftgenError(f"{path} was held by another process for over {wait:g} s")
        if waited >= LOCK_NOTICE and not noticed:
            waiting()
            noticed = True
        time.sleep(0.05)


def open_lock(path: Path) -> int:
    """A read-write descriptor of the lock file at `path`, created if absent (see `_open_in_place`)."""

    def failure(exc: OSError) -> AftgenError:
        return AftgenError(f"cannot lock {path.parent} ({exc.strerror or exc})")

    return _open_in_place(path, os.O_RDWR | os.O_CREAT, "a lock file", failure)


def _open_in_place(path: Path | str, flags: int, what: str, failure: Callable[[OSError], AftgenError]) -> int:
    """A descriptor of the file at `path`, opened with `flags` to be changed in place (`failure` makes the error
    of an open that fails). A link there is refused, never followed (the change would reach the file it points
    to), and so is anything but a regular file with no other name (a FIFO would block; a hard link is another
    file's content under this name)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise AftgenError(f"{path} is a link, not {what} aftgen made: remove it and retry") from None
        raise failure(exc) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        kind = kind_of(info.st_mode) if not stat.S_ISREG(info.st_mode) else "a file with another name (a hard link)"
        raise AftgenError(f"{path} is {kind}, not {what} aftgen made: remove it and retry")
    return fd


def _holders_pid(fd: int, wait: float = 0.1) -> str:
    """The PID of the process that holds the lock: it writes it just after it locks, so a lock taken a moment
    ago may show it only a few milliseconds later ("" if it never comes)."""
    deadline = time.monotonic() + wait
    while not (pid := _read_pid(fd)) and time.monotonic() < deadline:
        time.sleep(0.005)
    return pid


def _read_pid(fd: int) -> str:
    """The PID in a lock file ("" when there is none: just created, or cut short)."""
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return text if text.isdecimal() else ""


def _holds_a_pid(fd: int) -> bool:
    """Whether a lock file holds what aftgen writes there: a PID and a newline, or nothing yet."""
    text = os.pread(fd, 33, 0)
    return len(text) <= 32 and (text.strip() == b"" or text.strip().isdigit())


def still_names(path: Path | str, fd: int) -> bool:
    """Whether `path` is still the file open as `fd`: not removed, nor replaced (a link there is not it), since
    it was opened. A lock taken on a file that its holder removed meanwhile locks nothing."""
    try:
        here, there = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def append_durably(path: Path | str, data: bytes) -> None:
    """Add `data` at the end of the regular file `path` and sync it to disk (see `_open_in_place`)."""
    with _open_to_change(path, os.O_APPEND) as handle:
        try:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        except OSError as exc:
            raise _write_error(Path(path), exc) from None


def truncate(path: Path | str, size: int) -> None:
    """Cut the regular file `path` to `size` bytes (see `_open_in_place`)."""
    with _open_to_change(path) as handle:
        try:
            os.ftruncate(handle.fileno(), size)
        except OSError as exc:
            raise _write_error(Path(path), exc) from None


def _open_to_change(path: Path | str, flags: int = 0) -> BinaryIO:
    """The existing file `path` opened for writing in place (see `_open_in_place`)."""
    fd = _open_in_place(path, os.O_WRONLY | flags, "a file", lambda exc: _write_error(Path(path), exc))
    return os.fdopen(fd, "wb")


def is_count(value: object) -> bool:
    """Whether a value read back from a JSON record is a whole number >= 0 (JSON's true and false are not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def atomic_write(path: Path | str, data: bytes | str, durable: bool = True) -> None:
    """Write bytes or text to `path` atomically (see `atomic_open`)."""
    with atomic_open(path, "wb", durable) as handle:
        handle.write(data.encode("utf-8") if isinstance(data, str) else data)
