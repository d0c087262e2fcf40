"""The compiled step's packages in aftgen's cache, checked before they are loaded.

A package (step-KEY.pt2, the zip the compiler writes) and the shared library extracted from it beside it
(step-KEY.so, which the CPU's runner dlopens) are recorded when written: their sizes and SHA-256 in
step-KEY.json. Both are compared with the record before either is loaded, as a damaged one fails badly: a
library cut short is mapped past its end and kills the process with SIGBUS, and a package that does not open
fails every later start. An entry that does not match is deleted and built again, with one line saying so;
one that cannot be deleted is a CacheUnusable naming what to delete. Hashing a few MB costs a start a few ms.

The cache is a convenience, not a condition. An entry that matches its record is read without its lock, so a
read-only cache serves what it holds; nothing in it is read through a link. Everything is built in a private
temporary folder and then copied in: torch's package writer aborts the process on a full disk, so it never
writes into the cache. Where the cache cannot take an entry (a read-only or full disk, a lock that is a FIFO or
a link, or held by another process past LOCK_WAIT, a linked or blocked folder, a damaged entry that cannot be
deleted), the process runs its private build, deleted at exit, and one line says why.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import msgspec

from aftgen import files
from aftgen.errors import AftgenError
from aftgen.files import read_bytes  # the door's (a bare name: files.read_bytes reads as a Path's to its scan)

FILE_LIMIT = 1 << 30  # a package or its library: the step's code without weights (a few MB for the shipped model)
RECORD_LIMIT = 4096
WHAT = "a compiled step's file"
FROM_CACHE = " (from the cache)"
LOCK_WAIT = 300.0  # seconds a start waits for another process building the same entry before building its own
FilesOf = Callable[[Path], dict[str, Path]]  # an entry's files by their names in its record
_private_folders: list[tempfile.TemporaryDirectory] = []  # what this process built outside the cache: gone at exit
_said: set[str] = set()  # why this process built outside the cache, as it told stderr


class Fingerprint(msgspec.Struct, frozen=True):
    """A file's size and SHA-256, as recorded when it was written."""

    size: int
    sha256: str


class Recorded(msgspec.Struct, frozen=True):
    """step-KEY.json: the fingerprints of an entry's files (a library of aftgen's own has no package)."""

    package: Fingerprint | None = None
    library: Fingerprint | None = None


class CacheUnusable(AftgenError):
    """The cache cannot hold an entry (a damaged one that cannot be deleted, a file or link where its folder
    should be, a lock that cannot be had); the message says why. The entry is then built privately."""


def library_of(package: Path) -> Path:
    """Where the package's shared library is extracted: beside it."""
    return package.with_suffix(".so")


def _record_of(package: Path) -> Path:
    return package.with_suffix(".json")


def compiled_folder() -> Path:
    """Where compiled code is kept: in aftgen's cache folder, which outlives a reboot (unlike /tmp)."""
    return files.cache_dir() / "compiled"


def cached_package(package: Path, build: Callable[[Path], None]) -> tuple[Path, str]:
    """`package`, its library beside it, and FROM_CACHE where the cache holds both as recorded; else both built
    now (`build(package)` writes the package), recorded, and "" (see _cached)."""

    def build_with_library(path: Path) -> None:
        build(path)
        _extract_library(path)

    return _cached(package, _package_files, build_with_library, "the compiled step")


def cached_library(library: Path, build: Callable[[Path], None]) -> tuple[Path, str]:
    """A shared library of aftgen's own (aftgen.native.library) that `build(library)` writes, checked and recorded as a
    package is; and FROM_CACHE where the cache held it intact."""
    return _cached(library, _library_files, build, "aftgen's native library")


def _package_files(package: Path) -> dict[str, Path]:
    return {"package": package, "library": library_of(package)}


def _library_files(library: Path) -> dict[str, Path]:
    return {"library": library}


def _cached(path: Path, files_of: FilesOf, build: Callable[[Path], None], what: str) -> tuple[Path, str]:
    """`path` as the cache holds it where each of `files_of(path)` matches its record, else built again (`what`:
    its name in the lines that say so); or built into a private folder where the cache cannot have it."""
    try:
        return _from_cache(path, files_of, build, what)
    except CacheUnusable as exc:
        _say_private(exc)
        return _built_privately(path.name, build), ""


def _from_cache(path: Path, files_of: FilesOf, build: Callable[[Path], None], what: str) -> tuple[Path, str]:
    """`path` as the cache holds it, else rebuilt under its lock; a CacheUnusable where the cache cannot have it."""
    _check_folder(path.parent)
    if not _damage(path, files_of(path)):  # finished and recorded: read without the lock, so a read-only cache serves
        return path, FROM_CACHE
    with contextlib.ExitStack() as held:
        # One process at a time: another one starting meanwhile would take a file built but not yet recorded
        # for a damaged one and delete it, and two compiling at once each take twice as long on a few cores.
        waiting = f"waiting for another aftgen process to build {what} in {path.parent} (at most {LOCK_WAIT:g} s)"
        try:
            held.enter_context(files.locked_file(path.with_suffix(".lock"), LOCK_WAIT, lambda: _say(waiting)))
        except AftgenError as exc:  # a FIFO or link planted there, a read-only disk, a holder past LOCK_WAIT
            raise CacheUnusable(str(exc)) from None
        return _rebuilt(path, files_of, build, what)


def _rebuilt(path: Path, files_of: FilesOf, build: Callable[[Path], None], what: str) -> tuple[Path, str]:
    """Under the entry's lock: `path` as the cache holds it if another process built it meanwhile, else built
    into a private folder and copied into the cache (that copy, or the private one where the copy fails)."""
    if os.path.lexists(path):
        damage = _damage(path, files_of(path))
        if not damage:
            return path, FROM_CACHE
        _say(f"warning: {what} in the cache was damaged ({damage}): compiling it again")
    for stale in (*files_of(path).values(), _record_of(path)):  # what a rebuild could not write over
        _delete(stale)
    built = _built_privately(path.name, build)
    try:
        _store(built, path, files_of)
    except AftgenError as exc:  # a full or read-only disk: this process runs what it built
        _say_private(exc)
        _forget(path, files_of)
        return built, ""
    return path, ""


def _built_privately(name: str, build: Callable[[Path], None]) -> Path:
    """`build` run into a new folder of this process's own (deleted at exit): the path it wrote there. torch's
    package writer aborts the process on a full disk, so it never writes into the cache."""
    folder = tempfile.TemporaryDirectory(prefix="aftgen-compiled-", ignore_cleanup_errors=True)
    try:
        build(Path(folder.name) / name)
    except BaseException:
        folder.cleanup()
        raise
    _private_folders.append(folder)
    return Path(folder.name) / name


def _store(built: Path, path: Path, files_of: FilesOf) -> None:
    """Copy the files built at `built` into the cache as `path`'s, then their record: last, so that a crash
    before it leaves files without a record, which the next start builds again. None needs an fsync: a crash
    that loses one leaves a file that differs from the record."""
    record = {}
    for name, stored in files_of(path).items():
        data = read_bytes(files_of(built)[name], FILE_LIMIT, WHAT, follow=False)
        files.atomic_write(stored, data, durable=False)
        record[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    files.atomic_write(_record_of(path), json.dumps(record), durable=False)
    if damage := _damage(path, files_of(path)):
        raise AftgenError(f"the cache reads back other than it was written ({damage}): check the disk")


def _forget(path: Path, files_of: FilesOf) -> None:
    """Delete what a copy that failed left of the entry, so the next start does not take it for a damaged one."""
    for stored in (*files_of(path).values(), _record_of(path)):
        with contextlib.suppress(OSError):  # best effort: what is left is checked, and rebuilt, as any damage
            stored.unlink()


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _say_private(problem: AftgenError) -> None:
    """Say why compiled code goes into a private folder: once a process for each reason (the step and the library
    meet the same read-only disk)."""
    line = f"warning: {files.shown(problem, 400)}: compiled code is kept in a private temporary folder"
    if line not in _said:
        _said.add(line)
        _say(line)


def _check_folder(folder: Path) -> None:
    """Create the cache's folder, or say what is in its way (nothing in the cache is read through a link)."""
    if folder.is_symlink():
        raise CacheUnusable(f"{folder} is a link, which aftgen never makes: remove it to keep compiled code there")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise CacheUnusable(f"{folder} is not a folder: delete it to keep the compiled step in the cache") from None
    except OSError as exc:
        raise CacheUnusable(f"cannot create {folder} ({exc.strerror or exc}) for the compiled step") from None


def _damage(path: Path, files_of: dict[str, Path]) -> str:
    """Why one of the cache's files of `path` differs from its record ("" where all match it)."""
    try:
        record = files.read_record(_record_of(path), Recorded, RECORD_LIMIT, "a compiled step's record")
    except AftgenError as exc:
        return files.shown(exc) if os.path.lexists(_record_of(path)) else "no record of its files"
    for name, path in files_of.items():
        try:
            found = _fingerprint(path)
        except AftgenError as exc:
            return files.shown(exc)
        if Fingerprint(**found) != getattr(record, name):
            return f"{path.name} ({found['size']:,} bytes) is not the file recorded"
    return ""


def _fingerprint(path: Path) -> dict:
    """The size and SHA-256 of the regular file at `path` (a link is refused: the file loaded is the one checked)."""
    with files.open_regular(path, FILE_LIMIT, WHAT, follow=False) as handle:
        return _read_fingerprint(handle, path)


def _read_fingerprint(handle: BinaryIO, path: Path) -> dict:
    try:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    except OSError as exc:
        raise AftgenError(f"cannot read {WHAT} {path} ({exc.strerror or exc})") from None
    return {"size": handle.tell(), "sha256": digest}


def _delete(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        raise CacheUnusable(
            f"the compiled step in the cache is damaged and {path} cannot be deleted ({exc.strerror or exc}): "
            "delete it to compile the step again"
        ) from None


def _extract_library(package: Path) -> None:
    """Write the package's shared library beside it: the CPU's runner dlopens a file."""
    with files.open_regular(package, FILE_LIMIT, WHAT, follow=False) as handle, zipfile.ZipFile(handle) as archive:
        members = [name for name in archive.namelist() if name.endswith(".so")]
        if len(members) != 1:
            raise RuntimeError(f"{package} holds {len(members)} libraries, not one")
        files.atomic_write(library_of(package), archive.read(members[0]), durable=False)  # its CRC checked


def use_persistent_compile_cache() -> None:
    """Keep PyTorch's compile caches (inductor's FX graph and AOTAutograd caches) in compiled_folder(), so
    a second start compiles in seconds; a TORCHINDUCTOR_CACHE_DIR already set wins."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compiled_folder() / "torch"))
