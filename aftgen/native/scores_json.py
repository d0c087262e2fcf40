"""OpenAI's `logprobs` JSON of many tokens' scores in one call to the native library (scores_json.cpp says how):
what aftgen.serve.replies's ScoresWriter writes in Python, byte for byte.
"""

from __future__ import annotations

import ctypes
import functools

from aftgen.native.library import usable_library

UNIT, RECORD = "\x1f", "\x1e"  # scores_json.cpp's separators: JSON escapes both inside its strings
SCORE_PIECE = 1024  # tokens LibraryScoresWriter writes in one call


class _Names(ctypes.Structure):
    """scores_json.cpp's Names: a tokenizer's names and chat entries, made JSON, as one blob each with offsets."""

    _fields_ = [("text", ctypes.c_char_p), ("at", ctypes.POINTER(ctypes.c_int64)), ("entries", ctypes.c_char_p),
                ("entry_at", ctypes.POINTER(ctypes.c_int64)), ("first", ctypes.POINTER(ctypes.c_int32)),
                ("vocab", ctypes.c_int64)]  # fmt: skip


class LibraryScoresWriter:
    """The JSON of many tokens' scores in one call to the library (scores_json.cpp): what aftgen.serve.replies's
    ScoresWriter writes in Python, byte for byte; `names` and `entries` are its."""

    def __init__(self, loaded: ctypes.CDLL, names: list[str], entries: list[str]):
        first: dict[str, int] = {}
        firsts = (ctypes.c_int32 * len(names))(*[first.setdefault(name, token) for token, name in enumerate(names)])
        (text, at), (entry_text, entry_at) = _blob(names), _blob(entries)
        self._kept = (text, at, entry_text, entry_at, firsts)  # what self.names points into
        as_pointer = functools.partial(ctypes.cast, typ=ctypes.c_char_p)
        self.names = _Names(as_pointer(text), at, as_pointer(entry_text), entry_at, firsts, len(names))
        self.write = loaded.aftgen_score_json
        # the most a name (completions) or an entry's start (chat) takes, and what a token or an alternative adds to
        # it at most: a figure (15), separators and chat's `,"top_logprobs":[`
        self.longest = {False: max(at[i + 1] - at[i] for i in range(len(names))) + 24,
                        True: max(entry_at[i + 1] - entry_at[i] for i in range(len(names))) + 40}  # fmt: skip

    def __call__(self, tokens: list[tuple[int, int, bool, str]]) -> list[str]:
        """Each of `tokens` ((id, top, chat, score record) each) as JSON: completions' name, figure and map between
        UNIT separators, or chat's whole entry. A call a SCORE_PIECE tokens: an echo's thousands of prompt tokens do
        not hold the GIL, nor a buffer sized for all of them, at once."""
        return [
            shown for at in range(0, len(tokens), SCORE_PIECE) for shown in self._piece(tokens[at : at + SCORE_PIECE])
        ]

    def _piece(self, tokens: list[tuple[int, int, bool, str]]) -> list[str]:
        text = " ".join([f"{token} {top} {int(chat)} {record or '-'}" for token, top, chat, record in tokens]).encode()
        # a token and its alternatives (at most top, and at most what its record holds), each at most `longest`
        size = sum([(1 + min(top, max(0, len(record) // 8 - 1) // 2)) * self.longest[chat]
                    for _, top, chat, record in tokens])  # fmt: skip
        out = ctypes.create_string_buffer(size)
        written = self.write(ctypes.byref(self.names), text, len(text), len(tokens), out, size)
        if written < 0:
            raise ValueError(f"scores_json: {'a score record it cannot read' if written == -1 else 'no room'}")
        return ctypes.string_at(out, written).decode().split(RECORD) if tokens else []


def _blob(texts: list[str]) -> tuple[ctypes.Array, ctypes.Array]:
    """Texts as one UTF-8 buffer and the offsets of each one's start (and of the end)."""
    encoded = [text.encode() for text in texts]
    offsets = [0]
    for piece in encoded:
        offsets.append(offsets[-1] + len(piece))
    return ctypes.create_string_buffer(b"".join(encoded)), (ctypes.c_int64 * len(offsets))(*offsets)


def scores_json(names: list[str], entries: list[str]) -> LibraryScoresWriter | None:
    """The library's writer of `logprobs` JSON for these names, or None where the library cannot be had here."""
    loaded = usable_library()
    return None if loaded is None else LibraryScoresWriter(loaded, names, entries)
