"""OpenAI-style JSON errors from the router itself, ``{"error": {"message", "type", "param", "code"}}`` as the
engine writes them (the engines' own errors pass through as is).

Every response the router makes up is one: the handlers answer bad input with a 4xx, and
:func:`json_errors` turns what escapes them (aiohttp's own HTTP errors, a bug) into the same shape instead
of aiohttp's plain-text pages. A 500 means a bug in the router, never bad input. :func:`end_broken` ends a
response whose upstream failed after its first byte (the router's proxy and the scale-to-zero activator);
:func:`close_after` ends a connection whose request body was not read to its end (too slow, undecodable).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

log = logging.getLogger(__name__)
# status → OpenAI error type
_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",  # the client sent its request too slowly: its error, as a 400 or 413
    413: "invalid_request_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout",
}
_CODES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
#: the last event of an SSE stream
DONE = b"data: [DONE]\n\n"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_body(status: int, message: str, code: str | None = None) -> dict:
    return {
        "error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": None, "code": code}
    }


def error_response(
    status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response(error_body(status, message, code), status=status, headers=headers)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as error:
        if error.status < 400:
            raise  # redirects and the like are not errors
        return error_response(error.status, error.reason, _CODES.get(error.status, "http_error"))
    except Exception:
        if request.writer is not None and request.writer.output_size > 0:
            raise  # a response is already on its way: aiohttp closes the connection
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal router error", "internal_error")


async def end_broken(request: web.Request, response: web.StreamResponse, events: bool, error: dict) -> None:
    """End a response whose upstream failed to finish it: an SSE stream as the engine ends a failed one (an
    error event, then ``[DONE]``); any other body with a broken connection (no terminating chunk), so the
    client never takes it for a complete one."""
    if events:
        with contextlib.suppress(ConnectionResetError):
            await response.write(b"data: " + orjson.dumps(error) + b"\n\n" + DONE)
            await response.write_eof()
            return
    if request.transport is not None:
        request.transport.close()


async def close_after(request: web.Request, response: web.StreamResponse) -> None:
    """Send ``response`` and close the connection, the rest of the request body unread (aiohttp would linger
    10 s reading it first): for a body that did not arrive in time or does not decode."""
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()  # asyncio flushes what was written, then closes
