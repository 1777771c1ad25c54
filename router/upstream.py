"""The client of the proxied requests: one aiohttp ``ClientSession`` per replica, whose connector keeps its
keep-alive connections, with the router's timeouts and the one silent retry a keep-alive pool needs.

A pooled connection the engine closed while idle fails before any response byte, with no way to tell
whether the engine saw the request. Engines close idle connections only when no request is on them, so
that one failure, on a reused connection only, is retried once on a fresh one instead of counting against
the replica. A fresh connection that drops was dropped by an engine that had the request (it may have
read it and run it): re-sending a POST there could run it twice, so it is never retried (the rule of Go's
``net/http``; aiohttp itself re-sends only idempotent methods). Bodies pass byte for byte: nothing is
decompressed and no header is added but Host and Content-Length.

A replica that leaves the fleet keeps its session until its last request ends (a draining pod finishes
its streams); then the session and its connections close.

With ``read_bytes`` a response is read through a bounded buffer (aiohttp stops reading at twice
``read_bytes``) from a socket whose receive buffer is ``read_bytes`` (the kernel doubles it): the upstream
half of the router's per-stream byte budget, so a client that stops reading soon stops the router reading
and the engine pauses the request (docs/architecture.md#backpressure-and-cancellation).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import aiohttp
from multidict import CIMultiDict

#: what a failed connection raises before any response byte (the proxy retries such requests elsewhere)
UpstreamError = aiohttp.ClientError
AIOHTTP_READ_BUFSIZE = 1 << 16  # aiohttp's own default, without ``read_bytes``
# Headers aiohttp would add itself: a proxied request carries the client's or none.
_NO_AUTO_HEADERS = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")


class UpstreamClient:
    def __init__(
        self, connect_timeout_s: float, request_timeout_s: float, read_bytes: int | None = None
    ) -> None:
        self._read_bytes = read_bytes
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=connect_timeout_s)
        self._trace = aiohttp.TraceConfig()
        self._trace.on_request_headers_sent.append(_written)
        self._trace.on_request_chunk_sent.append(_written)
        self._trace.on_connection_reuseconn.append(_reused)
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._leaving: dict[str, aiohttp.ClientSession] = {}
        self._active: Counter[str] = Counter()
        self._closing: set[asyncio.Future[None]] = set()

    @contextlib.asynccontextmanager
    async def request(
        self,
        url: str,
        method: str,
        path: str,
        headers: CIMultiDict[str],
        body: bytes,
        on_written: Callable[[], None] | None = None,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """The replica's response to one request, open for streaming while the context lasts.
        ``on_written()`` runs once as the request goes onto its connection. Raises :class:`UpstreamError`
        or ``TimeoutError`` before the response's head."""
        session = self._session(url)
        self._active[url] += 1
        context = SimpleNamespace(on_written=on_written, reused=False)
        try:
            for attempt in range(2):
                context.reused = False
                try:
                    response = await session.request(
                        method,
                        url + path,
                        data=body or None,
                        headers=headers,
                        skip_auto_headers=_NO_AUTO_HEADERS,
                        allow_redirects=False,
                        trace_request_ctx=context,
                    )
                    break
                except aiohttp.ServerDisconnectedError:
                    if attempt or not context.reused:
                        raise
            async with response:
                yield response
        finally:
            self._active[url] -= 1
            if not self._active[url]:
                del self._active[url]
                leaving = self._leaving.pop(url, None)
                if leaving is not None:
                    await leaving.close()

    def forget(self, url: str) -> None:
        """The replica at ``url`` left the fleet: close its connections once its requests have ended."""
        session = self._sessions.pop(url, None)
        if session is None:
            return
        if self._active[url]:
            self._leaving[url] = session
        else:
            closing = asyncio.ensure_future(session.close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    @property
    def replicas(self) -> set[str]:
        """Replicas this client holds a session (and so connections) for."""
        return set(self._sessions) | set(self._leaving)

    async def close(self) -> None:
        for session in [*self._sessions.values(), *self._leaving.values()]:
            await session.close()
        if self._closing:
            await asyncio.gather(*self._closing)
        self._sessions.clear()
        self._leaving.clear()

    def _session(self, url: str) -> aiohttp.ClientSession:
        session = self._sessions.get(url)
        if session is None:
            session = self._sessions[url] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, socket_factory=self._socket),
                timeout=self._timeout,
                read_bufsize=self._read_bytes or AIOHTTP_READ_BUFSIZE,
                auto_decompress=False,
                trace_configs=[self._trace],
            )
        return session

    def _socket(self, addr_info: tuple) -> socket.socket:
        family, type_, proto = addr_info[:3]
        sock = socket.socket(family=family, type=type_, proto=proto)
        if self._read_bytes is not None:  # before connecting: the window scale is agreed on in the SYN
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._read_bytes)
        return sock


def error_text(error: BaseException) -> str:
    """An upstream error for a log line: its type and ``str()`` (status, message, URL), never its ``repr()``,
    which for a ``ClientResponseError`` holds the request's headers: the client's key, the router's token."""
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


async def _written(session: aiohttp.ClientSession, context: Any, params: Any) -> None:
    request_context = context.trace_request_ctx
    on_written = request_context.on_written if request_context is not None else None
    if on_written is not None:
        request_context.on_written = None
        on_written()


async def _reused(session: aiohttp.ClientSession, context: Any, params: Any) -> None:
    if context.trace_request_ctx is not None:
        context.trace_request_ctx.reused = True  # the request goes out on a pooled keep-alive connection
