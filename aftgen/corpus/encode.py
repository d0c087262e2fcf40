"""Streaming encoding: text in, token ids out, a chunk at a time, on every core.

aftgen's tokenizers split words before a space that follows a non-space (SentencePiece's
split_by_whitespace, with runs of spaces kept together), so no token can straddle such a point: text
cut there encodes to exactly the tokens of the whole. Chunks are cut there, and each chunk is encoded
word by word: natural text repeats its words, so most are looked up in a cache of recent words rather
than encoded again (about twice as fast as SentencePiece on the whole text). A "word" longer than
`piece_chars` (text with no spaces) is cut anyway; its tokens may then differ from one-shot encoding,
but still decode to the exact text, since every piece decodes to itself.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import os
import re
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from aftgen.device import release_freed_memory
from aftgen.tokenizer import Tokenizer

CHUNK_CHARS = 4_000_000  # what one worker encodes at a time, and the unit a killed preparation continues from
PIECE_CHARS = 4096  # longer words are cut into pieces of this size
CACHED_WORD = 64  # longer words are encoded each time, not remembered
CACHE_WORDS = 1 << 18  # words remembered per worker (about 40 MB)
_WORD = re.compile(r" *[^ ]+| +")  # SentencePiece's words: a run of spaces and the non-spaces after it


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


class WordEncoder:
    """Encodes text word by word, remembering the encodings of recent words."""

    def __init__(self, tokenizer: Tokenizer, dtype: np.dtype, piece_chars: int = PIECE_CHARS):
        self.tokenizer, self.dtype, self.piece_chars = tokenizer, np.dtype(dtype), piece_chars
        self.cache: dict[str, bytes] = {}

    def __call__(self, text: str) -> np.ndarray:
        words = _WORD.findall(text)
        distinct = set(words)
        new = distinct.difference(self.cache)
        if len(self.cache) + len(new) > CACHE_WORDS:  # full: keep only the words this chunk uses
            self.cache = {word: self.cache[word] for word in distinct.intersection(self.cache)}
        long = [word for word in new if len(word) > CACHED_WORD]
        self.cache.update(zip(new, self._encode(list(new)), strict=True))
        encoded = b"".join(map(self.cache.__getitem__, words))
        for word in long:  # seldom seen again: not worth their memory
            del self.cache[word]
        return np.frombuffer(encoded, dtype=self.dtype)

    def _encode(self, words: list[str]) -> list[bytes]:
        cuts = [list(cut(word, self.piece_chars)) for word in words]
        ids = iter(self.tokenizer.encode_many([piece for pieces in cuts for piece in pieces]))
        return [np.array([i for _ in pieces for i in next(ids)], dtype=self.dtype).tobytes() for pieces in cuts]


_worker: WordEncoder | None = None


def _start_worker(model_proto: bytes, dtype: str, piece_chars: int) -> None:
    global _worker
    _worker = WordEncoder(Tokenizer(model_proto), np.dtype(dtype), piece_chars)


def _encode_in_worker(text: str) -> bytes:
    encoded = _worker(text).tobytes()
    release_freed_memory()
    return encoded


Labelled = tuple[object, str]  # a chunk of text with a label of the caller's
Encode = Callable[[Iterable[Labelled]], Iterator[tuple[object, str, np.ndarray]]]


@contextlib.contextmanager
def encoder(tokenizer: Tokenizer, dtype: np.dtype, workers: int, piece_chars: int = PIECE_CHARS) -> Iterator[Encode]:
    """A function from (label, chunk) pairs to (label, chunk, its token ids), in order, on `workers` processes."""
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        encode = WordEncoder(tokenizer, dtype, piece_chars)
        yield lambda labelled: ((label, text, encode(text)) for label, text in labelled)
        return
    # Forked workers: they need no imports of their own, and share what this process has loaded.
    context = multiprocessing.get_context("fork")
    with context.Pool(workers, _start_worker, (tokenizer.model_proto, np.dtype(dtype).str, piece_chars)) as pool:
        yield lambda labelled: _in_order(pool, labelled, np.dtype(dtype), 2 * workers)


def _in_order(
    pool, labelled: Iterable[Labelled], dtype: np.dtype, depth: int
) -> Iterator[tuple[object, str, np.ndarray]]:
    """Keep `depth` chunks in the workers' hands (no more: the text is read as fast as it is encoded)."""
    pending: collections.deque = collections.deque()
    for label, text in labelled:
        pending.append((label, text, pool.apply_async(_encode_in_worker, (text,))))
        if len(pending) >= depth:
            label, text, result = pending.popleft()
            yield label, text, np.frombuffer(result.get(), dtype=dtype)
    while pending:
        label, text, result = pending.popleft()
        yield label, text, np.frombuffer(result.get(), dtype=dtype)
