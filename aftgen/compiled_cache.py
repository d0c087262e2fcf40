"""The compiled step's packages in aftgen's cache, checked before they are loaded.

A package (step-KEY.pt2, the zip the compiler writes) and the shared library extracted from it beside it
(step-KEY.so, which the CPU's runner dlopens) are recorded when written: their sizes and SHA-256 in
step-KEY.json. Both are compared with the record before either is loaded, as a damaged one fails badly: a
library cut short is mapped past its end and kills the process with SIGBUS, and a package that does not open
fails every later start. An entry that does not match is deleted and built again, with one line saying so;
one that cannot be deleted is a CacheUnusable naming what to delete. Hashing a few MB costs a start a few ms.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import msgspec

from aftgen import files
from aftgen.errors import AftgenError

FILE_LIMIT = 1 << 30  # a package or its library: the step's code without weights (a few MB for the shipped model)
RECORD_LIMIT = 4096
WHAT = "a compiled step's file"


class Fingerprint(msgspec.Struct, frozen=True):
    """A file's size and SHA-256, as recorded when it was written."""

    size: int
    sha256: str


class Recorded(msgspec.Struct, frozen=True):
    """step-KEY.json: the fingerprints of an entry's files (a library of aftgen's own has no package)."""

    package: Fingerprint | None = None
    library: Fingerprint | None = None


class CacheUnusable(AftgenError):
    """The cache cannot hold the compiled step (a damaged entry that cannot be deleted, a file where its folder
    should be); the message names what to delete."""


def library_of(package: Path) -> Path:
    """Where the package's shared library is extracted: beside it."""
    return package.with_suffix(".so")


def _record_of(package: Path) -> Path:
    return package.with_suffix(".json")


def compiled_folder() -> Path:
    """Where compiled code is kept: in aftgen's cache folder, which outlives a reboot (unlike /tmp)."""
    return files.cache_dir() / "compiled"


def cached_package(package: Path, build: Callable[[Path], None]) -> tuple[Path, str]:
    """`package`, its library beside it, and " (from the cache)" where the cache holds both as recorded;
    else both built now (`build(package)` writes the package) and recorded, and ""."""
    files_of = {"package": package, "library": library_of(package)}
    return _cached(package, files_of, build, _record_package, "the compiled step")


def cached_library(library: Path, build: Callable[[Path], None]) -> tuple[Path, str]:
    """A shared library of aftgen's own (aftgen.rowdot) that `build(library)` writes, checked and recorded as a
    package is; and " (from the cache)" where the cache held it intact."""
    return _cached(library, {"library": library}, build, _record_library, "the batch-invariant product's library")


def _cached(
    path: Path, recorded: dict[str, Path], build: Callable[[Path], None], record: Callable[[Path], None], what: str
) -> tuple[Path, str]:
    """`path` as the cache holds it where each of `recorded`'s files matches its record, else built again
    (`what`: its name in the line that says so)."""
    _check_folder(path.parent)
    # One process at a time: another one starting meanwhile would take a file built but not yet recorded
    # for a damaged one and delete it, and two compiling at once each take twice as long on a few cores.
    with files.locked_file(path.with_suffix(".lock")):
        if os.path.lexists(path):
            damage = _damage(path, recorded)
            if not damage:
                return path, " (from the cache)"
            print(f"warning: {what} in the cache was damaged ({damage}): compiling it again",
                  file=sys.stderr, flush=True)  # fmt: skip
        for stale in (*recorded.values(), _record_of(path)):  # what a rebuild could not write over
            _delete(stale)
        build(path)
        record(path)
    return path, ""


def _check_folder(folder: Path) -> None:
    """Create the cache's folder, or say what is in its way."""
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
    """The size and SHA-256 of the regular file at `path`."""
    with files.open_regular(path, FILE_LIMIT, WHAT) as handle:
        return _read_fingerprint(handle, path)


def _record_library(library: Path) -> None:
    """Record the library as written: nothing was read back from it yet, so what is recorded was built."""
    files.atomic_write(_record_of(library), json.dumps({"library": _fingerprint(library)}), durable=False)


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


def _record_package(package: Path) -> None:
    """Extract the package's library beside it, check what was written, and record both files. Neither needs
    an fsync: a crash that loses one leaves a file that differs from the record, which the next start rebuilds."""
    with files.open_regular(package, FILE_LIMIT, WHAT) as handle:  # one handle: the package recorded is the one read
        package_read = _read_fingerprint(handle, package)
        handle.seek(0)
        with zipfile.ZipFile(handle) as archive:
            members = [name for name in archive.namelist() if name.endswith(".so")]
            if len(members) != 1:
                raise RuntimeError(f"{package} holds {len(members)} libraries, not one")
            library = archive.read(members[0])  # its CRC checked
    written = {"size": len(library), "sha256": hashlib.sha256(library).hexdigest()}
    files.atomic_write(library_of(package), library, durable=False)
    if _fingerprint(library_of(package)) != written:
        raise AftgenError(f"{library_of(package)} reads back other than it was written: check the disk")
    record = {"package": package_read, "library": written}
    files.atomic_write(_record_of(package), json.dumps(record), durable=False)
