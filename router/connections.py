"""The router's client connections: each accepted one gets the router's :class:`ConnectionLimits` (the client
side of ``--stream-buffer-bytes``, and ``--write-stall-timeout``), and a request aiohttp cannot parse (a bad
request line, bad headers, a line too long) is answered with an OpenAI-style JSON error instead of
aiohttp's plain-text page.

aiohttp answers unparsable requests in its connection handler (``RequestHandler.handle_error``), before
any middleware runs, so the router's middleware (``errors.json_errors``) never sees them: the handler class
itself is replaced. aiohttp builds its connection handlers in ``Server.__call__`` from the ``Server`` its
runner makes in ``AppRunner._make_server``; :class:`RouterRunner` rebuilds that ``Server`` as a
:class:`_Server` making :class:`_Handler`\\ s, with the same handler, request factory and options.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from kvpilot.engine.server.connection import ConnectionLimits
from kvpilot.router.errors import error_response

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

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.limits is not None:
            self.limits.apply(transport)

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
    def __init__(self, made: web.Server, limits: ConnectionLimits) -> None:
        super().__init__(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            loop=made._loop,
            **made._kwargs,
        )
        self._handler_class = type("RouterConnection", (_Handler,), {"limits": limits})

    def __call__(self) -> RequestHandler:
        return self._handler_class(self, loop=self._loop, **self._kwargs)


class RouterRunner(web.AppRunner):
    """``web.AppRunner`` whose connections are :class:`_Handler`\\ s bounded by ``limits``."""

    def __init__(self, app: web.Application, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._limits = limits

    async def _make_server(self) -> web.Server:
        return _Server(await super()._make_server(), self._limits)
