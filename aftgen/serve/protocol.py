"""HTTP/1.1 connections that cannot be held open by a client that stops sending.

uvicorn times out an idle kept-alive connection, but not one whose request's headers never finish
arriving: forty clients that each send half their headers would hold forty connections forever.
Here a connection waiting for a request's headers is closed when a whole `read_timeout` has gone by
with no request begun (a slow body is the app's to time: `Server._body` answers 408).
"""

from __future__ import annotations

import asyncio

import h11
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
