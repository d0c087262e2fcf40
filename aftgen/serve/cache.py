"""States kept by the token prefix they read, so a prompt that extends one reads only its new tokens.

A recurrent state cannot be cut back to an earlier token (llama.cpp #22940), so the cache keeps the
state at whole prompts' ends and where their last pieces start (a prompt is read in pieces fixed from its
start: generation.prompt.PROMPT_CHUNK says why). A hit must leave the rest of the prompt to be read in those same
pieces, so it is a state at a piece's end or after the whole prompt: a chat that sends its history again
finds the state where that history's last piece starts, and reads that piece and its new turn. Bounded in
megabytes, least recently used out first.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

from aftgen.model import ModelState, clone_state


def state_bytes(state: ModelState) -> int:
    return sum(t.numel() * t.element_size() for layer in state for t in layer.values())


@dataclass
class Hit:
    """A cached state (a copy: the cache's own stays untouched) and how many leading tokens it has read."""

    state: ModelState
    logits: torch.Tensor  # (1, vocab): the scores after the last of those tokens
    tokens: int


def _key(ids: list[int]) -> bytes:
    """Token ids as int32 bytes: a prefix of ids is then a prefix of the bytes, and compact to keep."""
    return array("i", ids).tobytes()


def _tokens(key: bytes) -> int:
    """How many ids a key holds."""
    return len(key) // array("i").itemsize


class PrefixCache:
    def __init__(self, megabytes: float, piece: int):
        """`piece`: the ids a piece of prompt is read in (the server's --prompt-chunk)."""
        self.capacity, self.piece = int(megabytes * 1e6), piece
        self.entries: OrderedDict[bytes, tuple[ModelState, torch.Tensor, int]] = OrderedDict()
        self.size = 0

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, ids: list[int]) -> Hit | None:
        """The state after the longest cached prefix of `ids` that ends a piece of it or is all of it, or None."""
        wanted = _key(ids)

        def usable(key: bytes) -> bool:
            return wanted.startswith(key) and (key == wanted or _tokens(key) % self.piece == 0)

        best = max(filter(usable, self.entries), key=len, default=None)
        if best is None:
            return None
        self.entries.move_to_end(best)
        state, logits, _ = self.entries[best]
        return Hit(clone_state(state), logits.clone(), _tokens(best))

    def put(self, ids: list[int], state: ModelState, logits: torch.Tensor) -> None:
        """Keep a copy of the state after `ids`, dropping the least recently used entries to fit."""
        key = _key(ids)
        size = state_bytes(state) + logits.numel() * logits.element_size() + len(key)
        if size > self.capacity:
            return
        if key in self.entries:
            self.size -= self.entries.pop(key)[2]
        while self.size + size > self.capacity:
            self.size -= self.entries.popitem(last=False)[1][2]
        self.entries[key] = (clone_state(state), logits.clone(), size)
        self.size += size
