"""The HTTP protocol stage serve runs on: uvicorn's h11 protocol with a deadline for a request's
line and headers, which uvicorn has not (its timeouts are the keep-alive one, between requests,
and the drain's; a body's deadline is the app's ``serve.read_timeout_s``).

A connection must send its first request's headers within ``serve.header_timeout_s`` of opening,
and every later request its headers within that of its first byte; more bytes trickling in do not
move the deadline. A client that misses it (a slowloris) gets ``408 Request Timeout``, one JSON
line, and the connection is closed. A kept-alive connection idle between requests is uvicorn's
keep-alive timeout's to close, as before.
"""
from __future__ import annotations

import asyncio
import json
from typing import Callable, Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def header_timeout_protocol(timeout_s: float, on_timeout: Callable[[], None]) -> type[H11Protocol]:
    """An :class:`H11Protocol` whose requests' headers must arrive within ``timeout_s``;
    ``on_timeout`` is called for every connection answered 408."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: Optional[asyncio.TimerHandle] = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:  # after every read, and after every response
            super().handle_events()
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                self._disarm()  # the headers are in (or the connection is ending)
            elif self.conn.trailing_data[0]:
                self._arm()  # a request has begun and its headers are not complete

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(timeout_s, self._timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _timed_out(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            on_timeout()
            body = json.dumps({"error": f"the request headers did not arrive within serve.header_timeout_s="
                                        f"{timeout_s:g} s"}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            try:  # h11 lets a server answer before a request: the case 408 is for
                self.transport.write(self.conn.send(h11.Response(status_code=408, reason=b"Request Timeout",
                                                                 headers=headers))
                                     + self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage()))
            except h11.LocalProtocolError:  # not in a state to answer: close without one
                pass
            self.transport.close()

    return HeaderTimeoutProtocol
