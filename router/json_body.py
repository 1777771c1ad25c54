"""Request bodies → JSON through orjson, with Python's ``json`` (the engine's parser) for what orjson refuses.

The router reads a body only to route it (its prompt, tenant and output budget) and forwards the raw bytes,
so the engine's parser stays the authority on what a body means.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson
from aiohttp import hdrs, web
from aiohttp.compression_utils import HAS_BROTLI, HAS_ZSTD
from aiohttp.http_exceptions import ContentEncodingError

#: the Content-Encodings aiohttp's request parser decodes here (``br`` and ``zstd`` only with their
#: library); it passes any other through undecoded, which would reach the parser as garbage
DECODED_ENCODINGS = ("gzip", "deflate") + ("br",) * HAS_BROTLI + ("zstd",) * HAS_ZSTD


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


def unsupported_encoding(value: str) -> BodyError:
    """The 415 for a Content-Encoding this router cannot undo, naming those it can (as the engine does)."""
    accepted = ", ".join(DECODED_ENCODINGS)
    return BodyError(
        415,
        f"Content-Encoding {value!r} is not supported: send the body as {accepted} or identity (one coding)",
        "unsupported_encoding",
        closes=True,
        headers={"Accept-Encoding": accepted},
    )


def check_content_encoding(request: web.Request) -> None:
    """Raises the 415, before the body is read, for a Content-Encoding aiohttp passes through undecoded
    (anything but one of :data:`DECODED_ENCODINGS`; ``identity`` or none is the body as sent)."""
    value = request.headers.get(hdrs.CONTENT_ENCODING)
    if value is not None and value.strip().lower() not in ("", "identity", *DECODED_ENCODINGS):
        raise unsupported_encoding(value)


def payload_error(request: web.Request, error: web.RequestPayloadError) -> BodyError:
    """The 400 for a body aiohttp could not read: it does not decode as its Content-Encoding says, or it
    breaks its framing (chunked encoding, a short body)."""
    if isinstance(error.__cause__, ContentEncodingError):
        encoding = request.headers.get(hdrs.CONTENT_ENCODING, "")
        message = f"request body is not valid {encoding} (its Content-Encoding)"
        return BodyError(400, message, "invalid_encoding", closes=True)
    return BodyError(400, "request body does not match its framing", "invalid_body", closes=True)


async def read_json_object(
    request: web.Request, max_bytes: int, timeout_s: float
) -> tuple[bytes, dict[str, Any]]:
    """The body as aiohttp decoded it (its Content-Encoding undone: what is forwarded) and its JSON object.
    A declared Content-Length over ``max_bytes`` is refused unread (a client declaring 30 MB gets its answer
    before sending any of it), as is a Content-Encoding it cannot decode (415); a body that takes longer than
    ``timeout_s`` to arrive gets 408; one that does not decode as its Content-Encoding says, or breaks its
    framing, gets 400."""
    check_content_encoding(request)
    too_large = BodyError(413, f"request body exceeds {max_bytes} bytes", "request_too_large")
    if request.content_length is not None and request.content_length > max_bytes:
        raise too_large
    try:  # wait_for, not asyncio.timeout(): that is Python 3.11+, and kvpilot supports 3.10
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except TimeoutError:
        raise BodyError(
            408, f"the request body did not arrive within {timeout_s:g} s", "request_timeout", closes=True
        ) from None
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    except web.RequestPayloadError as error:
        raise payload_error(request, error) from None
    try:
        body = parse_json(raw)
    except ValueError as error:
        raise BodyError(400, f"request body must be a JSON object: {error}", "invalid_json") from None
    if not isinstance(body, dict):
        raise BodyError(400, "request body must be a JSON object", "invalid_json")
    return raw, body
