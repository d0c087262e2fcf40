"""Corpus reading, the train/held-out split, the on-disk token cache and training batches."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from aftgen.errors import AftgenError
from aftgen.files import atomic_write
from aftgen.tokenizer import Tokenizer, train_tokenizer

HELD_OUT_FRACTION = 0.1  # the last 10% of characters, as nanoGPT splits Tiny Shakespeare


def cache_dir() -> Path:
    """Where tokenizers and token ids are cached: $AFTGEN_CACHE, else $XDG_CACHE_HOME/aftgen."""
    if os.environ.get("AFTGEN_CACHE"):
        return Path(os.environ["AFTGEN_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "aftgen"


def read_text(path: Path | str, encoding: str = "utf-8", errors: str = "strict") -> str:
    """Read a text file, with one clear error for anything that is not readable text."""
    path = Path(path)
    if not path.exists():
        raise AftgenError(f"{path}: no such file")
    if path.is_dir():
        raise AftgenError(f"{path}: is a directory, expected a text file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise AftgenError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not data:
        raise AftgenError(f"{path}: file is empty")
    # A stray NUL is just a character; many of them mean a binary file (or UTF-16 text).
    if data.count(b"\x00") * 1000 > len(data) and encoding.lower().replace("-", "") == "utf8":
        raise AftgenError(f"{path}: full of NUL bytes, so it looks binary; pass a text file (or --encoding utf-16)")
    try:
        text = data.decode(encoding, errors=errors)
    except UnicodeDecodeError as exc:
        raise AftgenError(
            f"{path}: not valid {encoding} (bad byte at offset {exc.start}); pass --encoding or --errors replace"
        ) from None
    except LookupError:
        raise AftgenError(f"unknown encoding '{encoding}'") from None
    if not text.strip():
        raise AftgenError(f"{path}: file holds only whitespace")
    return text


def split_text(text: str) -> tuple[str, str]:
    """The training part and the held-out part (the last 10% of characters)."""
    cut = int((1 - HELD_OUT_FRACTION) * len(text))
    return text[:cut], text[cut:]


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def cached_tokenizer(train_text: str, vocab_size: int, kind: str, log=print) -> Tokenizer:
    """Train a tokenizer on the training split, or reuse the one trained before on the same text."""
    key = f"{_digest(train_text.encode('utf-8'))}-{kind}-{vocab_size}"
    path = cache_dir() / "tokenizers" / f"{key}.model"
    if path.exists():
        try:
            return Tokenizer.load(path)
        except AftgenError:
            pass  # a damaged cache entry is simply rebuilt
    tokenizer = train_tokenizer(train_text, vocab_size, kind, log=log)
    atomic_write(path, tokenizer.model_proto)
    return tokenizer


def cached_ids(text: str, tokenizer: Tokenizer) -> torch.Tensor:
    """Token ids of `text` (a BOS first), memory-mapped from a cache keyed by text and tokenizer."""
    key = f"{_digest(text.encode('utf-8'))}-{_digest(tokenizer.model_proto)}"
    path = cache_dir() / "tokens" / f"{key}.int32"
    if not path.exists():
        ids = torch.tensor([tokenizer.bos_id, *tokenizer.encode(text)], dtype=torch.int32)
        atomic_write(path, bytes(ids.untyped_storage()))
    count = path.stat().st_size // 4
    return torch.from_file(str(path), shared=False, size=count, dtype=torch.int32)


def batch(
    ids: torch.Tensor, batch_size: int, length: int, generator: torch.Generator, rank: int = 0, world_size: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of `length` + 1 tokens: inputs and next-token targets, (B, length) each.

    With several processes, each draws the same global batch of world_size x B windows and keeps
    its own B rows, so the processes together see exactly what one process with the global batch sees.
    """
    starts = torch.randint(0, len(ids) - length - 1, (batch_size * world_size,), generator=generator)
    mine = starts[rank * batch_size : (rank + 1) * batch_size]
    rows = torch.stack([ids[s : s + length + 1] for s in mine.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]
