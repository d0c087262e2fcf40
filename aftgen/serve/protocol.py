"""uvicorn, made to fit a server that must not be held up or kept awake: HTTP/1.1 connections that cannot be
held open by a client that stops sending or stops reading, no more of them than the process has descriptors for,
and a server loop that sleeps while idle.

uvicorn times out an idle kept-alive connection, but not one whose request's headers never finish
arriving: forty clients that each send half their headers would hold forty connections forever.
Here a connection waiting for a request's headers is closed when a whole `read_timeout` has gone by
with no request begun (a slow body is the app's to time: `Server._body` answers 408). Nor does it time
a reply its client leaves unread: the reply waits in the process's memory until the client leaves, so
here one whose unsent part has not shrunk for a whole `read_timeout` is dropped. And it accepts connections
until the process runs out of descriptors (then it logs an error a second while requests and /health
wait); here one past `max_connections` gets a 503 and is closed at once. Its server loop wakes once a
second for the Date header; here the header is dated as each request arrives, and the loop sleeps until
told to exit.
"""

from __future__ import annotations

import asyncio
import email.utils
import functools
import json
import socket
import struct
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

OVERLOADED = {
    "error": {
        "message": "this server has as many connections open as it takes (--max-connections); try again shortly",
        "type": "server_error",
        "param": None,
        "code": "server_overloaded",
    }
}


def _refusal() -> bytes:
    body = json.dumps(OVERLOADED).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


REFUSAL = _refusal()
NO_LINGER = struct.pack("ii", 1, 0)  # SO_LINGER on, for 0 s: closing the socket resets the connection at once


class BoundedConnection(H11Protocol):
    """uvicorn's h11 connection, closed when its client takes longer than `read_timeout` to send headers, dropped
    when it leaves its reply unread as long, and refused when `max_connections` others are open."""

    read_timeout = 10.0
    max_connections = 1024
    _unread: asyncio.TimerHandle | None = None  # the check of a reply waiting to be read
    _headers_due: asyncio.TimerHandle | None = None  # the check of a connection waiting for a request

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:  # `connections` holds this one too
            transport.write(REFUSAL)
            transport.close()
            return
        self._arm()

    def handle_events(self) -> None:
        """Date the replies of the requests about to begin: uvicorn's server loop would, once a second."""
        dated = _date_header(int(time.time())) if self.config.date_header else []
        self.server_state.default_headers = dated + self.config.encoded_headers
        super().handle_events()

    def connection_lost(self, exc: Exception | None) -> None:
        """Cancel this connection's checks: left to fire, a burst of clients that came and went would wake an
        idle server hundreds of times."""
        for check in (self._headers_due, self._unread):
            if check is not None:
                check.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._headers_due = self.loop.call_later(self.read_timeout, self._check, self.cycle)

    def _check(self, cycle: object) -> None:
        """Close the connection if it waited for headers and no request began since the last check."""
        if self.transport.is_closing():
            return
        if self.cycle is cycle and self.conn.their_state is h11.IDLE:
            self.transport.close()
        else:
            self._arm()

    def pause_writing(self) -> None:
        """The reply waits in the transport's buffer, past its high-water mark, for the client to read it."""
        super().pause_writing()
        self._watch_unread(self.transport.get_write_buffer_size())

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._unread is not None:
            self._unread.cancel()

    def _watch_unread(self, unsent: int) -> None:
        self._unread = self.loop.call_later(self.read_timeout, self._check_unread, unsent)

    def _check_unread(self, unsent: int) -> None:
        """Drop the connection (and the reply it holds) if none of its reply was read since the last check."""
        if not self.flow.write_paused:  # read meanwhile, or the connection is gone
            return
        left = self.transport.get_write_buffer_size()
        if left >= unsent:  # reset, not closed: a close leaves what the kernel holds of the reply for it to send
            self.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, NO_LINGER)
            self.transport.abort()
        else:
            self._watch_unread(left)


@functools.lru_cache(maxsize=1)
def _date_header(second: int) -> list[tuple[bytes, bytes]]:
    return [(b"date", email.utils.formatdate(second, usegmt=True).encode())]


def bounded_connections(read_timeout: float, max_connections: int) -> type[BoundedConnection]:
    """The connection class for uvicorn's `http` setting, with these bounds."""
    bounds = {"read_timeout": read_timeout, "max_connections": max_connections}
    return type("BoundedConnection", (BoundedConnection,), bounds)


class QuietServer(uvicorn.Server):
    """uvicorn's server, whose loop sleeps until told to exit: each wake costs CPU, and uvicorn's own timer
    (for the Date header, which BoundedConnection now sets, and the exit check) kept an idle server measurably
    busy (figures: docs/benchmarks.md)."""

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
        if not self.should_exit:  # asked before the loop was known, the setter could not wake it
            await self._exit_asked.wait()
