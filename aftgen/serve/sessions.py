"""Named sessions: a conversation's whole context kept between requests, and on disk if asked.

A session is an `aftgen.sampling.Context`, the same thing `aftgen sample --save-state` writes, and
its file is that very format: `aftgen sample --load-state DIR/NAME.safetensors` continues it, and a
restarted server picks it up where it stopped.
"""

from __future__ import annotations

import contextlib
import re
from collections import OrderedDict
from pathlib import Path

from aftgen.model import AFTLM
from aftgen.sampling import Context
from aftgen.state import load_state, save_state
from aftgen.tokenizer import Tokenizer

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def valid_name(name: str) -> bool:
    """Letters, digits, '_', '.', '-' (64 at most, not starting with a dot): safe as a file name."""
    return NAME.fullmatch(name) is not None


class SessionStore:
    """Sessions by name: the `limit` most recently used in memory; with a folder, the `max_files` most
    recently used on disk too (the least recently used one's file is removed, and the session is gone)."""

    def __init__(self, model: AFTLM, tokenizer: Tokenizer, folder: Path | None, limit: int, max_files: int):
        self.model, self.tokenizer, self.folder, self.limit, self.max_files = model, tokenizer, folder, limit, max_files
        self.held: OrderedDict[str, Context] = OrderedDict()
        self.on_disk: OrderedDict[str, None] = OrderedDict()  # least recently saved first
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            saved = [path for path in folder.glob("*.safetensors") if valid_name(path.stem) and path.is_file()]
            self.on_disk.update((path.stem, None) for path in sorted(saved, key=lambda path: path.stat().st_mtime))

    def __len__(self) -> int:
        return len(self.held)

    def path(self, name: str) -> Path | None:
        return None if self.folder is None else self.folder / f"{name}.safetensors"

    def get(self, name: str) -> Context | None:
        """The session's context (the store's own: it changes as the session goes on), or None if new.

        Raises AftgenError if its file is damaged or belongs to another model.
        """
        if name in self.held:
            self.held.move_to_end(name)
            return self.held[name]
        path = self.path(name)
        if path is None or not path.exists():
            return None
        context = load_state(path, self.model, self.tokenizer)
        self._hold(name, context)
        return context

    def put(self, name: str, context: Context) -> None:
        """Keep the session's context after a request, writing its file (atomically) if there is a folder.

        Raises AftgenError if the file cannot be written; the context is held in memory all the same.
        """
        self._hold(name, context)
        path = self.path(name)
        if path is None:
            return
        save_state(path, context, self.model, self.tokenizer)
        self.on_disk[name] = None
        self.on_disk.move_to_end(name)
        while len(self.on_disk) > self.max_files:
            oldest, _ = self.on_disk.popitem(last=False)
            self.held.pop(oldest, None)
            with contextlib.suppress(OSError):  # gone already, or something else in its place: not ours to fix
                self.path(oldest).unlink()

    def forget(self, name: str) -> None:
        """Drop a session from memory (its file, if any, stays: the next `get` reads it)."""
        self.held.pop(name, None)

    def _hold(self, name: str, context: Context) -> None:
        self.held[name] = context
        self.held.move_to_end(name)
        while len(self.held) > self.limit:
            self.held.popitem(last=False)
