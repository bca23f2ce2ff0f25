"""uvicorn's h11 protocol with a request-header timeout: a client that opens a connection (or starts its next
request on a kept-alive one) and does not finish sending the request line and headers within ``header_timeout``
seconds gets a ``408`` in OpenAI's error shape and the connection is closed.

uvicorn has no such timeout (``--timeout-keep-alive`` only covers a connection that sends nothing at all), so a
client sending headers one byte at a time would hold a connection forever. The request *body* timeout lives in
the app (:func:`kv8.entrypoints.openai.api_server.read_json_body`), where the 408 can go through the normal error path.

Invariant: the timer is armed exactly while the connection waits for the headers of a request (from the first
byte after the previous response, or from the connection's start) and is cancelled once uvicorn has parsed them
(a new request cycle exists) or the connection is lost.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


def header_timeout_protocol(header_timeout: float, on_timeout: Callable[[], None]) -> type[H11Protocol]:
    """An :class:`H11Protocol` subclass whose connections answer 408 after ``header_timeout`` seconds without
    complete request headers; ``on_timeout`` runs once per such 408 (to count it)."""
    body = json.dumps({"error": {
        "message": f"the request headers did not arrive within {header_timeout:g} s (--request-header-timeout)",
        "type": "invalid_request_error", "param": None, "code": "request_timeout"}}).encode()
    response = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _waiting_for_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _timed_out(self) -> None:
            self._header_timer = None
            if self._waiting_for_headers() and not self.transport.is_closing():
                on_timeout()
                self.transport.write(response)
                self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._waiting_for_headers():
                self._arm()
            super().data_received(data)
            if not self._waiting_for_headers():
                self._disarm()

    return HeaderTimeoutH11Protocol
