"""Request bodies → JSON through orjson, with Python's ``json`` (the engine's parser) for what orjson refuses.

The router reads a body only to route it (its prompt, tenant and output budget) and forwards the bytes, so
the engine's parser stays the authority on what a body means. Its Content-Encoding is undone here by the
engine's own decoder (``kvpilot.engine.server.body_encoding``; aiohttp's automatic decoding is off on the
router's connections), so router and engine refuse the same bodies with the same answers: gzip and deflate
decode within ``--max-body-bytes`` on the decoded size, a body that does not decode (truncated included) is
400 ``invalid_encoding``, any other coding 415 ``unsupported_encoding``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson
from aiohttp import hdrs, web

from kvpilot.engine.server.body_encoding import body_decoder
from kvpilot.engine.server.errors import APIError


def parse_json(raw: bytes) -> object:
    """Raises ``ValueError`` for a body that is not JSON, or nests too deeply to parse (Python's ``json``
    recurses per level: a 100k-deep body would otherwise escape as a RecursionError). orjson refuses NaN,
    lone surrogates and more than 1024 levels, which ``json`` reads as the engine does."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("the body nests too deeply") from None


class BodyError(ValueError):
    """A request body the router refuses: ``status`` and OpenAI error ``code`` for the client; ``closes``:
    the body was not (or cannot be) read to its end, so its connection cannot carry another request and the
    answer closes it (:func:`kvpilot.router.errors.close_after`)."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        closes: bool = False,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.closes = closes
        self.headers = headers


def _body_error(error: APIError) -> BodyError:
    headers = {k: v for k, v in error.headers().items() if k.lower() != "connection"}
    return BodyError(error.status, error.message, error.code, closes=error.closes, headers=headers or None)


async def read_body(request: web.Request, max_bytes: int, timeout_s: float) -> bytes:
    """The body, its Content-Encoding undone. A declared Content-Length over ``max_bytes`` is refused unread
    (a client declaring 30 MB gets its answer before sending any of it), as is a Content-Encoding it cannot
    decode (415); a body that takes longer than ``timeout_s`` to arrive gets 408; one that breaks its
    framing, or does not decode as its Content-Encoding says, gets 400; one over ``max_bytes``, sent or
    decoded, 413."""
    try:
        # repeated field lines are one comma-separated list (RFC 9110 §5.3), as the engine reads them
        codings = ", ".join(request.headers.getall(hdrs.CONTENT_ENCODING, ())) or None
        decoder = body_decoder(codings, max_bytes)
    except APIError as error:
        raise _body_error(error) from None
    too_large = BodyError(413, f"request body exceeds {max_bytes} bytes", "request_too_large")
    if request.content_length is not None and request.content_length > max_bytes:
        raise too_large
    try:  # wait_for, not asyncio.timeout(): that is Python 3.11+, and kvpilot supports 3.10
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:  # the builtin TimeoutError only from 3.11 on
        raise BodyError(
            408, f"the request body did not arrive within {timeout_s:g} s", "request_timeout", closes=True
        ) from None
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    except web.RequestPayloadError:  # it breaks its framing (chunked encoding, a short body)
        raise BodyError(400, "request body does not match its framing", "invalid_body", closes=True) from None
    if decoder is None:
        return raw
    try:
        decoded = decoder.feed(raw)
        decoder.finish()
    except APIError as error:
        raise _body_error(error) from None
    return decoded


async def read_json_object(
    request: web.Request, max_bytes: int, timeout_s: float
) -> tuple[bytes, dict[str, Any]]:
    """The body decoded (:func:`read_body`: what is forwarded) and its JSON object."""
    raw = await read_body(request, max_bytes, timeout_s)
    try:
        body = parse_json(raw)
    except ValueError as error:
        raise BodyError(400, f"request body must be a JSON object: {error}", "invalid_json") from None
    if not isinstance(body, dict):
        raise BodyError(400, "request body must be a JSON object", "invalid_json")
    return raw, body
