"""Limits on connections that uvicorn's h11 protocol does not have: a deadline
for the request head (uvicorn times out only the idle time between requests, so
a client that opens a socket and sends nothing, or sends its headers a byte at a
time, holds it for ever), and a cap on open connections that closes the oldest
idle ones first (uvicorn's `limit_concurrency` would instead answer 503 to real
requests while idle sockets hold every slot)."""

from __future__ import annotations

import json
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 10.0  # seconds from connecting (or from the first byte of a next request) to a full request head
KEEP_ALIVE_S = 5  # seconds an idle connection stays open between requests (uvicorn's timeout_keep_alive)
MAX_CONNECTIONS = 512  # open connections; past it the oldest ones not inside a request are closed
MAX_HEAD_BYTES = 16 << 10  # a request head still incomplete past this is refused (400; h11's own default)


class Connection(H11Protocol):
    """uvicorn's h11 protocol with a request-head deadline and the connection cap."""

    head_timer = None
    head_timeout = HEAD_TIMEOUT_S

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.opened = time.monotonic()
        self._arm()
        if len(self.connections) > MAX_CONNECTIONS:
            self._make_room()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # (part of) a request head: it must be complete in time
            if self.head_timer is None:
                self._arm()
        else:
            self._disarm()

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (a head over MAX_HEAD_BYTES, a malformed line):
        answered in the API's JSON error format, as every other error, not h11's text."""
        body = json.dumps({"error": {"message": f"invalid HTTP request: {msg}", "type": "invalid_request_error",
                                     "param": None, "code": "invalid_http_request"}}).encode()
        self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                             b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
        self.transport.close()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self.head_timer = self.loop.call_later(self.head_timeout, self._head_timeout)

    def _disarm(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timeout(self) -> None:
        self.head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()  # nothing was answered on it yet: no response is owed

    def _idle(self) -> bool:
        """Not inside a request: no head yet, or between requests."""
        return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

    def _make_room(self) -> None:
        # closed ones stay in `connections` until their connection_lost runs: not counted
        open_ = [c for c in self.connections if not c.transport.is_closing()]
        idle = sorted((c for c in open_ if isinstance(c, Connection) and c._idle()), key=lambda c: c.opened)
        for c in idle[: len(open_) - MAX_CONNECTIONS]:
            c.transport.close()


def with_head_timeout(seconds: float) -> type:
    """Connection with another request-head deadline (serve --header-timeout)."""
    return type("Connection", (Connection,), {"head_timeout": seconds})
