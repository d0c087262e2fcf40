"""The preparation cache: one folder per corpus, keyed by a streamed hash of its files' contents.

    $AFTGEN_CACHE/corpora/<corpus key>/
        tokenizer-<type>-<vocab size>-<sample>.model
        tokens-<key of the tokenizer and chunking>/    a set: the token files of one tokenizer
            held_out.bin, train.bin   token ids (uint16 or int32), a BOS before each document
            progress.json             while being written: how much of each file is complete
            tokens.json               written last: the token files are complete
            .lock                     held while the set is prepared or checked
            .in_use                   held (shared) by every process that uses the set; its time is its last use

Token files only ever grow by whole chunks: each chunk's ids are appended and synced to disk, then
progress.json is replaced atomically. A killed preparation leaves at worst a partial chunk past the
recorded end, which the next run cuts off before it carries on from there.

A corpus keeps the sets of its KEEP_SETS most recently used tokenizers: a run with a tokenizer used before
starts at once, and trying vocabularies does not fill the disk. Older sets are removed when a run takes its
own, but never one that another process holds in use. Tokenizers (kilobytes) are kept, so that a removed
set is only encoded again, with the same tokenizer, never trained again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated

import msgspec
import numpy as np
import torch

from aftgen.corpus.token_file import TokenFile
from aftgen.errors import AftgenError
from aftgen.files import (
    append_durably,
    atomic_write,
    cache_dir,
    locked_file,
    open_lock,
    open_regular,
    read_record,
    still_names,
    truncate,
)

FORMAT = 1  # bump when what a cache entry holds changes
PARTS = ("held_out", "train")
PROGRESS, MANIFEST, IN_USE = "progress.json", "tokens.json", ".in_use"
SET_PREFIX, PRUNING = "tokens-", ".pruning-"
# Token sets a corpus keeps (the most recently used): issue 49 measures four vocabularies on each corpus, and
# each fits beside the others (a set is about the size of the text at 2 bytes a token and 2-3 characters a
# token: four are three to four times the text); a fifth removes the least recently used.
KEEP_SETS = 4
_TORCH_DTYPES = {"uint16": torch.uint16, "int32": torch.int32}


def cache_key(payload: dict) -> str:
    """A short stable hash of a JSON-able description."""
    return hashlib.sha256(json.dumps({"format": FORMAT, **payload}, sort_keys=True).encode()).hexdigest()[:20]


def corpus_folder(key: str) -> Path:
    return cache_dir() / "corpora" / key


def _fresh() -> dict:
    return {"span": 0, "char": 0, "tokens": 0, "bytes": 0}


def _size(path: Path) -> int:
    """The size of the regular file at `path`, or -1: none there, or a link (never followed: cutting the token
    file back to its record would cut the file it points to; read as missing, the entry is prepared again)."""
    try:
        info = os.lstat(path)
    except OSError:
        return -1
    return info.st_size if stat.S_ISREG(info.st_mode) else -1


Count = Annotated[int, msgspec.Meta(ge=0)]


class Counts(msgspec.Struct):
    """How far a part's token file has got: spans read whole, characters read of the next, tokens, bytes."""

    span: Count
    char: Count
    tokens: Count
    bytes: Count


class Progress(msgspec.Struct):
    """progress.json: each part's counts."""

    held_out: Counts
    train: Counts


class Manifest(msgspec.Struct):
    """tokens.json: the ids' dtype and each part's counts (what else it holds is for people)."""

    dtype: str
    parts: Progress


Warn = Callable[[str], None]
ID_BLOCK = 1 << 22  # token ids checked at a time when a cached file is opened
RECORD_LIMIT = 1 << 20  # bytes: a progress record or manifest holds a few counts


class TokenFiles:
    """The token files of one corpus and tokenizer: written resumably, then memory-mapped.

    `spans` gives, per part, the characters of each of its spans: what a progress record or manifest
    must fit. Nothing read back from the cache is trusted before it is checked against them.
    """

    def __init__(self, folder: Path, dtype: np.dtype, spans: dict[str, list[int]], vocab_size: int):
        self.folder, self.dtype, self.spans, self.vocab_size = folder, np.dtype(dtype), spans, vocab_size
        self.progress = {part: _fresh() for part in PARTS}

    def path(self, part: str) -> Path:
        return self.folder / f"{part}.bin"

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Held while preparing: a second process preparing the same corpus waits, then finds it done."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with locked_file(self.folder / ".lock"):
            yield

    def use(self) -> InUse:
        """Hold the set in use until the handle returned is closed or dropped, and mark it used now: another
        process's pruning leaves it alone (a process preparing it holds it too, from before it starts)."""
        while True:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = open_lock(self.folder / IN_USE)
            fcntl.flock(fd, fcntl.LOCK_SH)
            if still_names(self.folder / IN_USE, fd):
                break
            os.close(fd)  # the set was pruned between our open and our lock: take the one made now
        now = time.time_ns()  # not the file system's coarser clock: two uses a millisecond apart keep their order
        os.utime(fd, ns=(now, now))
        return InUse(fd)

    def finished(self, warn: Warn) -> dict | None:
        """The manifest of complete token files, or None: never written, or damaged (`warn` hears why)."""
        if not (self.folder / MANIFEST).exists():
            return None
        manifest, problem = self._checked(MANIFEST, complete=True)
        if problem is None:
            return manifest
        warn(f"warning: {self.folder / MANIFEST} is damaged ({problem}); preparing that cache entry again")
        return None

    def resume(self, warn: Warn) -> bool:
        """Continue from the last complete chunk (True), or start from nothing (False)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            (self.folder / MANIFEST).unlink()  # a manifest whose files do not match it
        if (self.folder / PROGRESS).exists():
            progress, problem = self._checked(PROGRESS, complete=False)
            if problem is None:
                for part in PARTS:
                    truncate(self.path(part), progress[part]["tokens"] * self.dtype.itemsize)  # a chunk cut short
                self.progress = progress
                return True
            warn(f"warning: {self.folder / PROGRESS} is damaged ({problem}); preparing that cache entry from the start")
        for part in PARTS:
            atomic_write(self.path(part), b"")
        self.progress = {part: _fresh() for part in PARTS}
        return False

    def _checked(self, name: str, complete: bool) -> tuple[dict, str | None]:
        """A progress record or manifest read from the folder, and what is wrong with it (None: nothing)."""
        try:
            record = read_record(self.folder / name, Manifest if complete else Progress, RECORD_LIMIT, "its record")
        except AftgenError as exc:
            return {}, f"unreadable: {exc}"
        if complete and record.dtype != self.dtype.name:
            return {}, f"dtype {record.dtype!r}, expected {self.dtype.name}"
        checked = msgspec.to_builtins(record)
        return checked, self._problem(checked["parts"] if complete else checked, complete)

    def _problem(self, parts: dict[str, dict[str, int]], complete: bool) -> str | None:
        """What is wrong with the counts of a progress record or manifest (`complete`: every span read), or None.

        Its counts must fit the spans (every character is at least a byte, every document at least its
        BOS), the files must hold at least (complete: exactly) its tokens, and every id must be below
        the vocabulary size.
        """
        for part in PARTS:
            counts, spans = parts[part], self.spans[part]
            span, char, tokens = counts["span"], counts["char"], counts["tokens"]
            if span > len(spans) or (span == len(spans) and char) or (span < len(spans) and char > spans[span]):
                return f"'{part}' stops at character {char} of span {span}, which {len(spans)} spans cannot hold"
            if complete and span < len(spans):
                return f"'{part}' is unfinished"
            read = sum(spans[:span]) + char
            if counts["bytes"] < read or tokens < span + (char > 0):
                return f"'{part}' counts {tokens} tokens and {counts['bytes']} bytes for {read} characters"
            size = _size(self.path(part))
            wanted = tokens * self.dtype.itemsize
            if size < wanted or (complete and size != wanted):
                return f"{self.path(part).name} holds {max(size, 0)} bytes, not the {wanted} it should"
            highest = self._highest_id(part, tokens)
            if highest >= self.vocab_size:
                return f"{self.path(part).name} holds token id {highest}, past the vocabulary's {self.vocab_size}"
        return None

    def _highest_id(self, part: str, tokens: int) -> int:
        """The largest of a part's first `tokens` ids (-1 if none), read a block at a time (memory stays flat)."""
        highest = -1
        with open_regular(self.path(part), sys.maxsize, "token file") as handle:  # reads `tokens` ids, no more
            for start in range(0, tokens, ID_BLOCK):
                block = np.fromfile(handle, dtype=self.dtype, count=min(ID_BLOCK, tokens - start))
                highest = max(highest, int(block.max()))
        return highest

    def append(self, part: str, ids: np.ndarray, progress: dict) -> None:
        """Add a chunk's ids to a part, durably, then record how far the part has got with them."""
        append_durably(self.path(part), ids.astype(self.dtype, copy=False).tobytes())
        self.progress[part] = dict(progress)
        atomic_write(self.folder / PROGRESS, json.dumps(self.progress))

    def finish(self, manifest: dict) -> dict:
        manifest = {**manifest, "dtype": self.dtype.name, "parts": self.progress}
        atomic_write(self.folder / MANIFEST, json.dumps(manifest, indent=2) + "\n")
        with contextlib.suppress(FileNotFoundError):
            (self.folder / PROGRESS).unlink()
        return manifest

    def open(self, part: str, tokens: int) -> TokenFile | torch.Tensor:
        """A part's ids, memory-mapped (an empty tensor when there are none)."""
        dtype = _TORCH_DTYPES[self.dtype.name]
        return TokenFile(self.path(part), dtype, tokens) if tokens else torch.empty(0, dtype=dtype)


class InUse:
    """A set held in use: released when closed, or when the last reference to this is dropped."""

    def __init__(self, fd: int):
        self.close = weakref.finalize(self, os.close, fd)


def prune(corpus: Path, kept: Path, log: Warn) -> None:
    """Remove the token sets of the corpus folder `corpus` past its KEEP_SETS most recently used (`kept`, the one
    just taken, is never removed), but none that another process holds in use; one line names those removed."""
    sets = sorted(_sets(corpus), key=_last_used, reverse=True)
    removed = {path.name: size for path in sets[KEEP_SETS:] if path != kept and (size := _remove_unused(path)) >= 0}
    if removed:
        log(
            f"cache: removed {', '.join(removed)} ({sum(removed.values()) / 1e6:,.1f} MB) from {corpus}: the least "
            f"recently used token files of the corpus, past the {KEEP_SETS} sets it keeps"
        )


def _sets(corpus: Path) -> list[Path]:
    """The token sets in a corpus folder: folders named as sets (a link is none: its target is not the cache's)."""
    with os.scandir(corpus) as entries:
        return [Path(e.path) for e in entries if e.name.startswith(SET_PREFIX) and e.is_dir(follow_symlinks=False)]


def _last_used(folder: Path) -> int:
    """When the set was last used (its in-use lock file's time; the folder's, for a set made before them)."""
    for path in (folder / IN_USE, folder):
        with contextlib.suppress(OSError):
            return os.lstat(path).st_mtime_ns
    return 0


def _remove_unused(folder: Path) -> int:
    """Remove a set that no process holds in use: the bytes removed, or -1 (in use, or its lock file is not one
    aftgen made). Renamed first, then deleted: a process that comes for the set meanwhile finds none and makes
    it again, and a link inside is removed, never followed (shutil.rmtree's)."""
    try:
        fd = open_lock(folder / IN_USE)
    except AftgenError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        size = _bytes(folder)
        trash = folder.with_name(f"{PRUNING}{folder.name}-{os.getpid()}")
        folder.rename(trash)
        shutil.rmtree(trash)
        return size
    except OSError:  # BlockingIOError: in use
        return -1
    finally:
        os.close(fd)


def _bytes(folder: Path) -> int:
    with os.scandir(folder) as entries:
        return sum(e.stat(follow_symlinks=False).st_size for e in entries if e.is_file(follow_symlinks=False))
