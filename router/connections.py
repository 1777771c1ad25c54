"""The router's client connections. Each accepted one gets the router's :class:`ConnectionLimits` (the client
side of ``--stream-buffer-bytes``, and ``--write-stall-timeout``); a request aiohttp cannot parse (a bad
request line, bad headers, a line too long) is answered with an OpenAI-style JSON error instead of aiohttp's
plain-text page; aiohttp leaves bodies as sent (its automatic decoding is off: ``json_body`` undoes a Content-
Encoding as the engine does); and a request head that has begun to arrive must be complete within ``--body-
read-timeout``, else 408 and the connection closes (aiohttp bounds a waiting connection only by its keep-alive
timeout, an hour by default, and a client trickling a head holds it that long).

aiohttp answers unparsable requests in its connection handler (``RequestHandler.handle_error``), before
any middleware runs, so the router's middleware (``errors.json_errors``) never sees them: the handler class
itself is replaced. aiohttp builds its connection handlers in ``Server.__call__`` from the ``Server`` its
runner makes in ``AppRunner._make_server``; :class:`RouterRunner` rebuilds that ``Server`` as a
:class:`_Server` making :class:`_Handler`\\ s, with the same handler, request factory and options. A head
is pending when bytes arrived while the handler waits for its next message (``_waiter``), which aiohttp
completes once a head is parsed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from kvpilot.engine.server.connection import ConnectionLimits, raw_json_response
from kvpilot.router.errors import error_body, error_response

#: longest parser message passed on to the client (it may quote the client's own bytes)
MAX_REASON_CHARS = 200


def error_for(status: int, reason: str | None) -> web.Response:
    """What a client gets for a request aiohttp refused before routing it (the connection then closes)."""
    if status >= 500:
        if status == 504:
            response = error_response(504, "the request timed out in the router", "timeout")
        else:
            response = error_response(500, "internal router error", "internal_error")
    else:
        detail = f": {reason[:MAX_REASON_CHARS]}" if reason else ""
        response = error_response(status, f"malformed HTTP request{detail}", "invalid_http_request")
    response.force_close()
    return response


class _Handler(RequestHandler):
    limits: ConnectionLimits | None = None
    head_timeout_s: float = 0.0  # 0: no head timeout
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.limits is not None:
            self.limits.apply(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._head_pending():
            self._stop_head_timer()
        elif data and self._head_timer is None and self.head_timeout_s > 0:
            self._head_timer = self._loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _head_pending(self) -> bool:
        waiter = self._waiter
        return waiter is not None and not waiter.done() and self.transport is not None

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._head_pending() and self.transport is not None:
            message = f"the request head did not arrive within {self.head_timeout_s:g} s"
            self.transport.write(raw_json_response(408, error_body(408, message, "request_timeout")))
            self.force_close()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs it; raises once a response has started
        return error_for(status, message)


class _Server(web.Server):
    def __init__(self, made: web.Server, limits: ConnectionLimits, head_timeout_s: float) -> None:
        super().__init__(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            loop=made._loop,
            **made._kwargs,
        )
        attributes = {"limits": limits, "head_timeout_s": head_timeout_s}
        self._handler_class = type("RouterConnection", (_Handler,), attributes)

    def __call__(self) -> RequestHandler:
        return self._handler_class(self, loop=self._loop, **self._kwargs)


class RouterRunner(web.AppRunner):
    """``web.AppRunner`` whose connections are :class:`_Handler`\\ s bounded by ``limits`` and whose request
    heads must arrive within ``head_timeout_s``."""

    def __init__(
        self, app: web.Application, limits: ConnectionLimits, head_timeout_s: float, **kwargs: Any
    ) -> None:
        super().__init__(app, auto_decompress=False, **kwargs)
        self._limits = limits
        self._head_timeout_s = head_timeout_s

    async def _make_server(self) -> web.Server:
        return _Server(await super()._make_server(), self._limits, self._head_timeout_s)
