"""Streaming encoding: text in, token ids out, a chunk at a time, on every core.

aftgen's tokenizers split words before a space that follows a non-space (SentencePiece's
split_by_whitespace, with runs of spaces kept together), so no token can straddle such a point: text
cut there encodes to exactly the tokens of the whole. A stretch with no such point (a very long
"word") is cut anyway; its tokens may then differ from one-shot encoding, but still decode to the
exact text, since every piece decodes to itself.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator

import numpy as np

from aftgen.tokenizer import Tokenizer

CHUNK_CHARS = 4_000_000  # the unit of work a killed preparation continues from
PIECE_CHARS = 16_384  # what one encoder thread takes at a time: SentencePiece is fastest on short inputs


def cpu_count() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits in it (half the disk and memory), else int32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def safe_cut(text: str, low: int, high: int) -> int:
    """The last offset in (low, high] where `text` can be cut with no token straddling the cut
    (before a space that follows a non-space); `high` if there is none."""
    space = text.rfind(" ", low + 1, high + 1)
    while space > low:
        if text[space - 1] != " ":
            return space
        space = text.rfind(" ", low + 1, space)
    return high


def cut(text: str, size: int) -> Iterator[str]:
    """`text` in pieces of at most `size` characters (at least half that, but for the last), cut safely."""
    start = 0
    while len(text) - start > size:
        stop = safe_cut(text, start + size // 2, start + size)
        yield text[start:stop]
        start = stop
    if start < len(text):
        yield text[start:]


def chunks(texts: Iterable[str], size: int) -> Iterator[str]:
    """A stream of text blocks re-cut into chunks of about `size` characters, cut safely.

    Where each cut falls depends only on the text from the previous cut on, so a stream restarted at
    any cut is cut as it was the first time."""
    rest = ""
    for text in texts:
        rest += text
        pieces = list(cut(rest, size))
        if len(rest) > size:  # all but the last piece are final; the last may grow with the next block
            yield from pieces[:-1]
            rest = pieces[-1]
    if rest:
        yield rest


def encode_chunk(tokenizer: Tokenizer, text: str, piece_chars: int, threads: int, dtype: np.dtype) -> np.ndarray:
    """The token ids of `text`, encoded in safely cut pieces on `threads` threads."""
    encoded = tokenizer.encode_many(list(cut(text, piece_chars)), threads)
    count = sum(map(len, encoded))
    return np.fromiter(itertools.chain.from_iterable(encoded), dtype=dtype, count=count)
