"""uvicorn's HTTP protocol (httptools, a dependency; h11 only where it is missing — uvicorn's own choice) with
three changes:

- every accepted connection gets the server's :class:`ConnectionLimits`;
- a request uvicorn cannot parse (a bad request line, bad headers) is answered with an OpenAI-style JSON
  400 instead of uvicorn's plain text (uvicorn passes on no parser detail, so neither does this);
- a request head (request line and headers) that has begun to arrive must be complete within
  ``head_timeout_s`` (the server's ``--body-read-timeout``), else 408 and the connection closes: uvicorn
  times out only idle connections, and a client trickling a head never is idle (slowloris on the head; the
  ingress gate bounds the body).

A head is pending when bytes arrived and no request cycle began for them: uvicorn starts a cycle (``cycle``,
both implementations) once a head is complete, and the previous one, if any, has finished its response.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from kvpilot.engine.server.connection import ConnectionLimits, raw_json_response
from kvpilot.engine.server.errors import APIError

MALFORMED = APIError(400, "malformed HTTP request (request line or headers)", code="invalid_http_request")


def malformed_request_response() -> bytes:
    """The whole 400 response written for a request that could not be parsed (the connection closes)."""
    return raw_json_response(400, MALFORMED.body())


def head_timeout_response(timeout_s: float) -> bytes:
    error = APIError(408, f"the request head did not arrive within {timeout_s:g} s", code="request_timeout")
    return raw_json_response(408, error.body())


def http_protocol(limits: ConnectionLimits, head_timeout_s: float) -> type[asyncio.Protocol]:
    """The protocol class to hand to ``uvicorn.Config(http=...)``."""

    class BoundedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            limits.apply(transport)

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_head_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            before = self.cycle
            super().data_received(data)
            if self.cycle is not before or (before is not None and not before.response_complete):
                self._stop_head_timer()  # a head completed, or this is a running request's body
            elif data and self._head_timer is None and not self.transport.is_closing():
                self._head_timer = self.loop.call_later(head_timeout_s, self._head_timed_out, before)

        def send_400_response(self, msg: str) -> None:
            self.transport.write(malformed_request_response())
            self.transport.close()

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self, cycle: object) -> None:
            self._head_timer = None
            if self.cycle is cycle and not self.transport.is_closing():
                self.transport.write(head_timeout_response(head_timeout_s))
                self.transport.close()

    return BoundedHTTPProtocol
