"""uvicorn's HTTP protocol (httptools where installed, else h11 — uvicorn's own choice) with two changes:
every accepted connection gets the server's :class:`ConnectionLimits`, and a request uvicorn cannot parse
(a bad request line, bad headers) is answered with an OpenAI-style JSON 400 instead of uvicorn's plain
text. The parser's reason is not passed on: uvicorn gives only its generic message.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from kvpilot.engine.server.connection import ConnectionLimits
from kvpilot.engine.server.errors import APIError

MALFORMED = APIError(400, "malformed HTTP request (request line or headers)", code="invalid_http_request")


def malformed_request_response() -> bytes:
    """The whole 400 response written for a request that could not be parsed (the connection closes)."""
    body = json.dumps(MALFORMED.body(), separators=(",", ":")).encode()
    head = (
        "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def http_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """The protocol class to hand to ``uvicorn.Config(http=...)``."""

    class BoundedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            limits.apply(transport)

        def send_400_response(self, msg: str) -> None:
            self.transport.write(malformed_request_response())
            self.transport.close()

    return BoundedHTTPProtocol
