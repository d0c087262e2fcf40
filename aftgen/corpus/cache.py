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
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from aftgen.data import TokenFile, cache_dir
from aftgen.files import atomic_write

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


class TokenFiles:
    """The token files of one corpus and tokenizer: written resumably, then memory-mapped."""

    def __init__(self, folder: Path, dtype: np.dtype):
        self.folder, self.dtype = folder, np.dtype(dtype)
        self.progress = {part: _fresh() for part in PARTS}

    def path(self, part: str) -> Path:
        return self.folder / f"{part}.bin"

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Held while preparing: a second process preparing the same corpus waits, then finds it done."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / ".lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def finished(self) -> dict | None:
        """The manifest of complete token files, or None (never written, or the files do not match it)."""
        try:
            manifest = json.loads((self.folder / MANIFEST).read_text())
            sizes = {part: self.path(part).stat().st_size for part in PARTS}
        except (OSError, ValueError):
            return None
        expected = {part: manifest["parts"][part]["tokens"] * self.dtype.itemsize for part in PARTS}
        return manifest if manifest.get("dtype") == self.dtype.name and sizes == expected else None

    def resume(self) -> bool:
        """Continue from the last complete chunk (True), or start from nothing (False)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            (self.folder / MANIFEST).unlink()  # a manifest whose files do not match it
        try:
            progress = json.loads((self.folder / PROGRESS).read_text())
            lengths = {part: progress[part]["tokens"] * self.dtype.itemsize for part in PARTS}
            if all(self.path(part).stat().st_size >= lengths[part] for part in PARTS):
                for part in PARTS:
                    os.truncate(self.path(part), lengths[part])  # drop a chunk that was cut short
                self.progress = progress
                return True
        except (OSError, ValueError, KeyError, TypeError):
            pass
        for part in PARTS:
            self.path(part).write_bytes(b"")
        self.progress = {part: _fresh() for part in PARTS}
        return False

    def append(self, part: str, ids: np.ndarray, progress: dict) -> None:
        """Add a chunk's ids to a part, durably, then record how far the part has got with them."""
        with open(self.path(part), "ab") as handle:
            handle.write(ids.astype(self.dtype, copy=False).tobytes())
            handle.flush()
            os.fsync(handle.fileno())
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
