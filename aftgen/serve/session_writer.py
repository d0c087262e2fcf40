"""Session files written on a thread of their own, in the order given: the fsync would hold every stream's turn.

A session's turn ends (its Finished and Done) once its file is written: the engine takes the written turns back,
in order, at its next turn (`written`), and no turn reads a session before its latest write.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from aftgen.errors import AftgenError
from aftgen.generation.context import Context
from aftgen.serve.rows import Row
from aftgen.serve.sessions import SessionStore
from aftgen.serve.work import Failed


class SessionWriter:
    """Writes the sessions' files of `sessions`, calling `wake` after each (the engine may be asleep)."""

    def __init__(self, sessions: SessionStore, wake: Callable[[], None]):
        self.sessions, self.wake = sessions, wake
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="aftgen-sessions")
        self.saving: deque[tuple[Row, Future]] = deque()

    def save(self, row: Row) -> None:
        """Write the file of the session whose turn `row` ended; `written` gives the row back once it is written."""
        name, context = row.ticket.work.session, row.stream.context
        saving = self.thread.submit(self._write, name, context)
        saving.add_done_callback(lambda _: self.wake())
        self.saving.append((row, saving))

    def _write(self, name: str, context: Context) -> Failed | None:
        """On the writer's thread: the session's file; a file that cannot be written fails this request alone, and
        the session stays as it was before the turn."""
        try:
            self.sessions.write(name, context)
        except (AftgenError, OSError) as exc:
            message = f"session '{name}' could not be saved ({exc}); it stays as it was before this request"
            return Failed(500, message, "server_error", "session_not_saved")
        return None

    def written(self) -> Iterator[tuple[Row, Failed | None]]:
        """The rows whose session files are written, in the order they were given, each with its failure (None:
        written)."""
        while self.saving and self.saving[0][1].done():
            row, saving = self.saving.popleft()
            yield row, saving.result()

    def any_written(self) -> bool:
        return bool(self.saving) and self.saving[0][1].done()

    def sessions_saving(self) -> set[str]:
        return {row.ticket.work.session for row, _ in self.saving}

    def stop(self) -> None:
        self.thread.shutdown()  # the files being written are written
