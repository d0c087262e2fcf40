"""Named sessions: a conversation's whole context kept between requests, and on disk if asked.

A session is an `aftgen.generation.context.Context`, the same thing `aftgen sample --save-state` writes, and
its file is that very format: `aftgen sample --load-state DIR/NAME.session.safetensors` continues it,
and a restarted server picks it up where it stopped. Only files named so are sessions: the store never
counts, reads or removes anything else in its folder.

A turn works on a copy (`get`) and the session changes only when the turn is over and `put` back: a
turn cancelled, timed out or failed on the way leaves it as it was, in memory and on disk.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections import OrderedDict
from pathlib import Path

import torch

from aftgen.errors import AftgenError
from aftgen.generation.context import Context
from aftgen.model import AFTLM
from aftgen.state import load_state, save_state
from aftgen.tokenizer import Tokenizer

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
SUFFIX = ".session.safetensors"  # a session's file: NAME + SUFFIX


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
            self.on_disk.update((name, None) for name in _sessions_oldest_first(folder))

    def __len__(self) -> int:
        return len(self.held)

    def path(self, name: str) -> Path | None:
        return None if self.folder is None else self.folder / f"{name}{SUFFIX}"

    def get(self, name: str) -> Context | None:
        """A copy of the session's context for a turn to work on (`put` it back when the turn is over),
        or None if the session is new.

        Raises AftgenError, naming the file but not its folder, if the file is damaged or another model's.
        """
        if name not in self.held:
            path = self.path(name)
            if path is None or not path.exists():
                return None
            with _folder_unsaid(path):
                self._hold(name, load_state(path, self.model, self.tokenizer))
        self.held.move_to_end(name)
        return _copy(self.held[name])

    def put(self, name: str, context: Context) -> None:
        """The session's context after a turn that is over: its file written (atomically) if there is a
        folder, then the context kept.

        Raises AftgenError, naming the file but not its folder, if the file cannot be written; the
        session then stays as it was, in memory and on disk.
        """
        if self.folder is not None:
            self.write(name, context)
        self.keep(name, context)

    def write(self, name: str, context: Context) -> None:
        """The session's file alone, written atomically (any thread: the store's records are left to `keep`).
        Raises AftgenError as `put` does."""
        path = self.path(name)
        with _folder_unsaid(path):
            save_state(path, context, self.model, self.tokenizer)

    def keep(self, name: str, context: Context, busy: set[str] = frozenset()) -> None:
        """The session's context held, once its file (if there is a folder) is written. Past max_files the least
        recently saved file goes, and its session, unless it is `busy` (its own file may be being written: it goes
        at a later turn's write)."""
        if self.folder is not None:
            self._count_file(name, busy)
        self._hold(name, context)

    def _count_file(self, name: str, busy: set[str]) -> None:
        """A session's file was just written: past max_files the least recently saved one goes, and its session."""
        self.on_disk[name] = None
        self.on_disk.move_to_end(name)
        while len(self.on_disk) > self.max_files:
            oldest = next((saved for saved in self.on_disk if saved not in busy and saved != name), None)
            if oldest is None:
                return
            del self.on_disk[oldest]
            self.held.pop(oldest, None)
            with contextlib.suppress(OSError):  # gone already, or something else in its place: not ours to fix
                self.path(oldest).unlink()

    def _hold(self, name: str, context: Context) -> None:
        self.held[name] = context
        self.held.move_to_end(name)
        while len(self.held) > self.limit:
            self.held.popitem(last=False)


def _sessions_oldest_first(folder: Path) -> list[str]:
    """The names of the session files in `folder`, least recently saved first. Entries are looked at, not
    followed (lstat): a link there may point anywhere, and a session file is a regular file the store wrote."""
    found = []
    with os.scandir(folder) as entries:
        for entry in entries:
            name = entry.name.removesuffix(SUFFIX)
            if entry.name.endswith(SUFFIX) and valid_name(name) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    found.append((entry.stat(follow_symlinks=False).st_mtime, name))
    return [name for _, name in sorted(found)]


def _copy(context: Context) -> Context:
    """An independent copy, its generator too: drawing from the copy leaves the original's untouched."""
    generator = torch.Generator()
    generator.set_state(context.generator.get_state())
    return context.fork(generator)


@contextlib.contextmanager
def _folder_unsaid(path: Path):
    """An error about a session's file names the file alone: a client must not learn the server's folders."""
    try:
        yield
    except AftgenError as exc:
        raise AftgenError(str(exc).replace(str(path), path.name)) from None
