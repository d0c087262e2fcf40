"""The preparation cache: one folder per corpus, keyed by a streamed hash of its files' contents.

    $AFTGEN_CACHE/corpora/<corpus key>/
        tokenizer-<type>-<vocab size>.model
        tokens-<key of the tokenizer and chunking>/
            held_out.bin, train.bin   token ids (uint16 or int32), a BOS before each document
            progress.json             while being written: how much of each file is complete
            tokens.json               written last: the token files are complete

Token files only ever grow by whole chunks: each chunk's ids are appended and synced to disk, then
progress.json is replaced atomically. A killed preparation leaves at worst a partial chunk past the
recorded end, which the next run cuts off before it carries on from there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from aftgen.corpus.token_file import TokenFile
from aftgen.errors import AftgenError
from aftgen.files import (
    append_durably,
    atomic_write,
    cache_dir,
    is_count,
    locked_file,
    open_regular,
    read_json,
    truncate,
)

FORMAT = 1  # bump when what a cache entry holds changes
PARTS = ("held_out", "train")
PROGRESS, MANIFEST = "progress.json", "tokens.json"
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
            record = read_json(self.folder / name, RECORD_LIMIT, "the cache's record")
        except AftgenError as exc:
            return {}, f"unreadable: {exc}"
        if not isinstance(record, dict):
            return {}, "not a JSON object"
        if complete and record.get("dtype") != self.dtype.name:
            return record, f"dtype {record.get('dtype')!r}, expected {self.dtype.name}"
        return record, self._problem(record.get("parts") if complete else record, complete)

    def _problem(self, parts: object, complete: bool) -> str | None:
        """What is wrong with the counts of a progress record or manifest (`complete`: every span read), or None.

        Its counts must fit the spans (every character is at least a byte, every document at least its
        BOS), the files must hold at least (complete: exactly) its tokens, and every id must be below
        the vocabulary size.
        """
        if not isinstance(parts, dict):
            return "its parts are not an object"
        for part in PARTS:
            counts, spans = parts.get(part), self.spans[part]
            if not isinstance(counts, dict) or not all(is_count(counts.get(key)) for key in _fresh()):
                return f"'{part}' lacks a count of span, char, tokens and bytes"
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
