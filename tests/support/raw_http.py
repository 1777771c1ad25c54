"""Bytes a well-behaved HTTP client would never send, on a raw socket: the reply parsed just enough to
check it (status, headers, body), read until the server closes. Importable because ``tests/conftest.py``
puts this folder on ``sys.path``."""

from __future__ import annotations

import asyncio
import json
import socket
from urllib.parse import urlsplit

#: requests no HTTP parser accepts: a request line that is not one, a header line without a colon, a
#: header name with a space, a version that does not exist
MALFORMED = (
    b"GARBAGE\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nBad Name: y\r\n\r\n",
    b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n",
)


def exchange(url: str, data: bytes, timeout_s: float = 10) -> tuple[int, dict[str, str], bytes]:
    """Send ``data``; the reply's status, headers (lower-case names) and body."""
    address = urlsplit(url)
    with socket.create_connection((address.hostname, address.port), timeout=timeout_s) as sock:
        sock.sendall(data)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return _parse(reply)


async def exchange_async(url: str, data: bytes, timeout_s: float = 10) -> tuple[int, dict[str, str], bytes]:
    """``exchange`` for a test whose server runs on its own event loop."""
    address = urlsplit(url)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    try:
        writer.write(data)
        reply = await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()
    return _parse(reply)


def _parse(reply: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def error_of(body: bytes) -> dict:
    """The OpenAI error object of a JSON error body (AssertionError naming the body if it is not one)."""
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        raise AssertionError(f"not an OpenAI error body: {body[:200]!r}") from None
    assert set(error) == {"message", "type", "param", "code"}, error
    return error
