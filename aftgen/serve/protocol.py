"""uvicorn, made to fit a server that must not be held up or kept awake: HTTP/1.1 connections that cannot be
held open by a client that stops sending, and a server loop that sleeps while idle.

uvicorn times out an idle kept-alive connection, but not one whose request's headers never finish
arriving: forty clients that each send half their headers would hold forty connections forever.
Here a connection waiting for a request's headers is closed when a whole `read_timeout` has gone by
with no request begun (a slow body is the app's to time: `Server._body` answers 408).
"""

from __future__ import annotations

import asyncio
import contextlib

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderDeadline(H11Protocol):
    """uvicorn's h11 connection, closed when its client takes longer than `read_timeout` to send headers."""

    read_timeout = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self.loop.call_later(self.read_timeout, self._check, self.cycle)

    def _check(self, cycle: object) -> None:
        """Close the connection if it waited for headers and no request began since the last check."""
        if self.transport.is_closing():
            return
        if self.cycle is cycle and self.conn.their_state is h11.IDLE:
            self.transport.close()
        else:
            self._arm()


def with_read_timeout(seconds: float) -> type[HeaderDeadline]:
    """The connection class for uvicorn's `http` setting, with this read timeout."""
    return type("HeaderDeadline", (HeaderDeadline,), {"read_timeout": seconds})


class QuietServer(uvicorn.Server):
    """uvicorn's server, whose housekeeping (the Date header, the exit check) wakes the event loop once a second
    instead of ten times, and at once when told to exit: on a 2-core VM a wake costs about 0.6 ms of CPU, so
    uvicorn's own timer kept an idle server at 0.6% of a core."""

    _loop: asyncio.AbstractEventLoop | None = None

    @property
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:  # set by a signal handler, the engine's reader thread or a test
        self._should_exit = value
        if value and self._loop is not None:
            self._loop.call_soon_threadsafe(self._exit_asked.set)

    async def main_loop(self) -> None:
        self._exit_asked = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        ticks = 0  # uvicorn's ticks of 0.1 s, which on_tick's once-a-second work counts
        while not await self.on_tick(ticks):
            ticks = (ticks + 10) % 864000
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._exit_asked.wait(), 1.0)
