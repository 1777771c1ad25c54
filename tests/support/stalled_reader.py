"""A client that stops reading its stream, on a raw socket, for the slow-reader tests of the engine server and
the router: it asks for a small receive buffer before connecting (so its own kernel holds little), reads
what it is told to, and says how much its kernel holds unread (FIONREAD). Importable because
``tests/conftest.py`` puts this folder on ``sys.path``.

``events`` finds the SSE events in the raw response (chunked framing included): each with the offset where
it ends in the raw bytes, so "bytes the server produced up to token k" can be set against "bytes the client
consumed or holds".
"""

from __future__ import annotations

import fcntl
import json
import socket
import struct
import termios
from dataclasses import dataclass
from urllib.parse import urlsplit

RECEIVE_BUFFER = 4096
#: a stream far larger than the 64 KiB stream budgets: 2 samples x 200 tokens with 20 logprobs each,
#: ~670 bytes per token, ~270 KB in all
LARGE_STREAM_REQUEST = {
    "prompt": "hello",
    "max_tokens": 200,
    "n": 2,
    "logprobs": 20,
    "ignore_eos": True,
    "temperature": 1.0,
    "seed": 7,
    "stream": True,
}


@dataclass(frozen=True)
class Event:
    end: int  # offset just past the event in the raw response
    data: dict | str  # the JSON object, or "[DONE]"


class StalledReader:
    def __init__(self, url: str, path: str, body: dict, headers: dict[str, str] | None = None) -> None:
        address = urlsplit(url)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        self.sock.settimeout(30)
        self.sock.connect((address.hostname, address.port))
        payload = json.dumps(body).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
        for name, value in (headers or {}).items():
            head += f"{name}: {value}\r\n"
        head += f"Content-Length: {len(payload)}\r\n\r\n"
        self.sock.sendall(head.encode() + payload)
        self.received = b""

    def read(self, at_least: int) -> None:
        """Read until ``at_least`` bytes in all have arrived (or the response ended)."""
        while len(self.received) < at_least:
            chunk = self.sock.recv(65536)
            if not chunk:
                return
            self.received += chunk

    def read_to_end(self) -> None:
        """Read until the connection closes or the stream's ``[DONE]`` and its final chunk have arrived;
        a reset connection ends the read too (``self.reset`` says so)."""
        self.reset = False
        try:
            while not self.received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
                chunk = self.sock.recv(65536)
                if not chunk:
                    return
                self.received += chunk
        except ConnectionResetError:
            self.reset = True

    @property
    def queued(self) -> int:
        """Bytes that arrived in this client's kernel and were not read yet."""
        return struct.unpack("i", fcntl.ioctl(self.sock, termios.FIONREAD, b"\0\0\0\0"))[0]

    def events(self) -> list[Event]:
        found, raw, at = [], self.received, self.received.find(b"\r\n\r\n")
        while (start := raw.find(b"data: ", at)) >= 0 and (end := raw.find(b"\n\n", start)) >= 0:
            text = raw[start + len(b"data: ") : end].decode()
            found.append(Event(end + 2, text if text == "[DONE]" else json.loads(text)))
            at = end + 2
        return found

    def close(self) -> None:
        self.sock.close()


def tokens_in(event: Event) -> int:
    """Tokens a completions event carries (its logprobs list one entry per token)."""
    if not isinstance(event.data, dict) or "choices" not in event.data:
        return 0
    return sum(len((c.get("logprobs") or {}).get("tokens", ())) for c in event.data["choices"])


def produced_through(events: list[Event], tokens: int, held_back: int = 0) -> int:
    """Raw bytes of the response up to the end of the event that carries its ``tokens``-th token. Up to
    ``held_back`` of them may never have been sent — generated, their text held back (an incomplete UTF-8
    character) when the request was cancelled — and take no bytes."""
    seen, last = 0, 0
    for event in events:
        carried = tokens_in(event)
        seen += carried
        if carried:
            last = event.end
        if seen >= tokens:
            return event.end
    if tokens - seen <= held_back:
        return last
    raise AssertionError(f"the stream carries {seen} tokens, fewer than {tokens}")
