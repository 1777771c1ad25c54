"""A lean HTTP/1.1 client for the proxied requests: keep-alive connections per replica, the request written in
one ``transport.write`` on the routing path, responses parsed by ``httptools`` (llhttp, the parser of
Node.js and uvicorn), body chunks handed over as they arrive.

Why not aiohttp's client (which the pollers still use): building a request through it costs ~0.5 ms of
Python on a busy core and yields to the event loop before writing, so other work (polls, relayed streams)
slips into the routing overhead. Here an idle connection is taken from the pool and written to without
yielding; only a new connection waits for its TCP connect.

A pooled connection the engine closed while idle fails before any response byte with no way to tell
whether the engine saw the request; since engines close idle connections only when no request is on them,
that one case is retried once on a fresh connection (as urllib3 does) instead of counting as a failure.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict

#: (host, port, TLS) of one replica's server
UpstreamKey = tuple[str, int, bool]


def upstream_key(url: str) -> UpstreamKey:
    """The connection key of a replica's base URL (``http://host:port`` or ``https://…``)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"replica URL must be http(s)://host[:port], got {url!r}")
    tls = parts.scheme == "https"
    return parts.hostname, parts.port or (443 if tls else 80), tls


class UpstreamError(Exception):
    """The connection failed (refused, reset, closed mid-body, or unparseable)."""


class UpstreamTimeout(TimeoutError):
    """No connection within the connect timeout, or the request outlived its total timeout."""


class UpstreamResponse(asyncio.Protocol):
    """One connection's protocol and, while a request is on it, that request's response."""

    def __init__(self, pool: UpstreamPool, key: UpstreamKey) -> None:
        self._pool = pool
        self._key = key
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.lost = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.reason = ""
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.content_length: int | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._headers_done = False
        self._keep_alive = False
        self._complete = False
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.any_byte = False

    # --- asyncio.Protocol --------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self.any_byte = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(UpstreamError(f"malformed response: {error}"))
            self._abort()
            return
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._pool.forget(self._key, self)
        if self._complete:
            return
        if self._headers_done and self.content_length is None and not _chunked(self.headers):
            self._complete = True  # a body delimited by the connection's end
        else:
            self._fail(
                UpstreamError(
                    "connection closed before the response ended"
                    if self.any_byte
                    else "connection closed before any response byte"
                )
            )
        self._wake()

    # --- httptools callbacks -----------------------------------------------------------------------------

    def on_status(self, status: bytes) -> None:
        self.reason += status.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.add(name.decode("latin-1"), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        length = self.headers.get("Content-Length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        # Asked now: llhttp resets its state once the message completes.
        self._keep_alive = self._parser.should_keep_alive()
        self._headers_done = True

    def on_body(self, body: bytes) -> None:
        self._chunks.append(bytes(body))

    def on_message_complete(self) -> None:
        self._complete = True

    # --- the request's side ------------------------------------------------------------------------------

    def send(self, head: bytes, body: bytes, timeout_s: float) -> None:
        assert self._transport is not None
        self._reset()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(loop.time() + timeout_s, self._expire)
        self._transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self._transport.write(body)

    async def wait_headers(self) -> None:
        while not self._headers_done and self._error is None:
            await self._wait()
        if self._error is not None:
            raise self._error

    async def read_chunk(self) -> bytes:
        """The next body bytes as they arrived; b"" once the body ended."""
        while not self._chunks and not self._complete and self._error is None:
            await self._wait()
        if self._chunks:
            return self._chunks.popleft()
        if self._error is not None:
            raise self._error
        return b""

    async def read_all(self) -> bytes:
        parts = []
        while chunk := await self.read_chunk():
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Done with this response: back to the pool if it ended cleanly and may be kept alive, else closed."""
        if self._complete and not self._chunks and self._error is None and not self.lost and self._keep_alive:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._pool.give_back(self._key, self)
        else:
            self.close()

    def close(self) -> None:
        """Close the connection now, whatever state its response is in."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._abort()

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()

    # --- internals ---------------------------------------------------------------------------------------

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: Exception) -> None:
        if self._error is None:
            self._error = error

    def _expire(self) -> None:
        self._fail(UpstreamTimeout("the upstream request outlived its timeout"))
        self._abort()
        self._wake()

    def _abort(self) -> None:
        self._pool.forget(self._key, self)
        if self._transport is not None:
            self._transport.abort()


class UpstreamPool:
    def __init__(self, connect_timeout_s: float, request_timeout_s: float, keep_spare: bool = False) -> None:
        """``keep_spare``: after a request took the last idle connection to a server, open one more in the
        background, so a request that finds the others busy (long streams) does not wait for a TCP connect."""
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self._keep_spare = keep_spare
        self._idle: dict[UpstreamKey, list[UpstreamResponse]] = {}
        self._connecting: set[UpstreamKey] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        #: servers that went away (:meth:`discard`) → when: a connection to one that ends its response is
        #: closed; kept no longer than any request there can last, so churning replicas do not pile up
        self._discarded: dict[UpstreamKey, float] = {}

    async def request(
        self, key: UpstreamKey, head: bytes, body: bytes, on_written: Callable[[], None] | None = None
    ) -> UpstreamResponse:
        """Send one request (``head``: request line and headers, from :func:`request_head`) to ``key``'s
        server and return once the response's headers arrived; the caller releases it (``async with``).
        ``on_written()`` runs once, right after the request was first written to a socket.
        Raises :class:`UpstreamError` or :class:`UpstreamTimeout`."""
        self._discarded.pop(key, None)
        connection = self._take_idle(key)
        if connection is not None:
            connection.send(head, body, self.request_timeout_s)
            if on_written is not None:
                on_written()
                on_written = None
            if self._keep_spare:
                self.preconnect(key)  # after the write: not on the request's path
            try:
                await connection.wait_headers()
                return connection
            except UpstreamError:
                connection.release()
                if connection.any_byte or not connection.lost:
                    raise
                # closed while idle, before any response byte: once more on a new connection
            except BaseException:
                connection.release()
                raise
        connection = await self._connect(key)
        connection.send(head, body, self.request_timeout_s)
        if on_written is not None:
            on_written()
        if self._keep_spare:
            self.preconnect(key)
        try:
            await connection.wait_headers()
        except BaseException:
            connection.release()
            raise
        return connection

    def preconnect(self, key: UpstreamKey) -> None:
        """Open a connection to ``key`` in the background unless one is idle or opening, so the first
        request there does not wait for a TCP connect (call when a replica becomes routable)."""
        self._discarded.pop(key, None)
        if self._idle.get(key) or key in self._connecting:
            return
        self._connecting.add(key)
        task = asyncio.get_running_loop().create_task(self._preconnect(key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _preconnect(self, key: UpstreamKey) -> None:
        try:
            connection = await self._connect(key)
        except (UpstreamError, UpstreamTimeout):
            return  # the replica's poller decides what a failing replica means; requests connect themselves
        finally:
            self._connecting.discard(key)
        self.give_back(key, connection)

    def give_back(self, key: UpstreamKey, connection: UpstreamResponse) -> None:
        if key in self._discarded:
            connection.close()
        else:
            self._idle.setdefault(key, []).append(connection)

    def forget(self, key: UpstreamKey, connection: UpstreamResponse) -> None:
        idle = self._idle.get(key)
        if idle and connection in idle:
            idle.remove(connection)
            if not idle:
                del self._idle[key]

    def discard(self, key: UpstreamKey) -> None:
        """``key``'s server left the fleet: close its idle connections now, and each busy one when its response
        ends, until a request or :meth:`preconnect` uses the key again."""
        now = time.monotonic()
        horizon = now - self.connect_timeout_s - self.request_timeout_s
        for old in [k for k, since in self._discarded.items() if since < horizon]:
            del self._discarded[old]
        self._discarded[key] = now
        for connection in self._idle.pop(key, []):
            connection.close()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        idle = [connection for connections in self._idle.values() for connection in connections]
        self._idle.clear()
        for connection in idle:
            connection.close()

    def _take_idle(self, key: UpstreamKey) -> UpstreamResponse | None:
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()
            if not idle:
                del self._idle[key]
            if not connection.lost:
                return connection
        return None

    async def _connect(self, key: UpstreamKey) -> UpstreamResponse:
        loop = asyncio.get_running_loop()
        host, port, tls = key
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, protocol = await loop.create_connection(
                    lambda: UpstreamResponse(self, key), host, port, ssl=tls or None
                )
        except TimeoutError:
            raise UpstreamTimeout(
                f"no connection to {host}:{port} within {self.connect_timeout_s} s"
            ) from None
        except OSError as error:
            raise UpstreamError(f"cannot connect to {host}:{port}: {error}") from None
        return protocol


def request_head(
    method: str, target: str, host: str, body_length: int, headers: Iterable[tuple[bytes, bytes]]
) -> bytes:
    """Request line and headers; ``headers`` (raw name/value bytes, passed through as the client sent them)
    must not hold hop-by-hop ones, Host or Content-Length."""
    start = f"{method} {target} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {body_length}\r\n".encode(
        "latin-1"
    )
    return start + b"".join(name + b": " + value + b"\r\n" for name, value in headers) + b"\r\n"


def _chunked(headers: CIMultiDict[str]) -> bool:
    return "chunked" in headers.get("Transfer-Encoding", "").lower()
