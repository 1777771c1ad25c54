"""The router's upstream HTTP/1.1 client against raw TCP servers: framing (chunked, length, until close),
keep-alive reuse, the one silent retry of a pooled connection closed while idle, and every failure mode the
proxy turns into a retry or a broken response."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from kvpilot.router.proxy import forward_raw_headers
from kvpilot.router.upstream import (
    UpstreamError,
    UpstreamPool,
    UpstreamTimeout,
    request_head,
    upstream_key,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
CHUNKED_SSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"9\r\ndata: a\n\n\r\n9\r\ndata: b\n\n\r\n0\r\n\r\n"
)
JSON_OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 8\r\n\r\n{"a": 1}'


class RawServer:
    """A TCP server whose ``handler`` sees each connection; counts connections and keeps the requests."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.key = upstream_key(f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self._handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client went away, or the test ended
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ),
            0,
        )
        request = head + await reader.readexactly(length)
        self.requests.append(request)
        return request


async def idle_connections(pool: UpstreamPool, key, count: int) -> None:
    """Wait (2 s at most) until ``pool`` holds ``count`` idle connections to ``key``."""
    for _ in range(200):
        if len(pool._idle.get(key, [])) == count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"idle connections never reached {count}")


def post(body: bytes = b"{}", path: str = "/v1/completions", headers=()) -> tuple[bytes, bytes]:
    return request_head("POST", path, "engine:8000", len(body), headers), body


def answering(*responses: bytes) -> Callable[[RawServer], Handler]:
    """A handler that answers each request on a connection with the next response, then keeps it open."""

    def make(server: RawServer) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for response in responses:
                await server.read_request(reader)
                writer.write(response)
                await writer.drain()
            await reader.read()  # until the client closes

        return handle

    return make


def first_chunk_then(then: Handler) -> Callable[[RawServer], Handler]:
    """A handler that reads one request, starts a chunked answer with the chunk ``first``, then runs ``then``."""

    def make(server: RawServer) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            await then(reader, writer)

        return handle

    return make


async def serve(make: Callable[[RawServer], Handler]) -> RawServer:
    server = RawServer(lambda r, w: handler(r, w))
    handler = make(server)
    return server


async def test_keep_alive_reuses_one_connection_for_chunked_and_sized_bodies():
    async with await serve(answering(CHUNKED_SSE, JSON_OK, CHUNKED_SSE)) as server:
        pool = UpstreamPool(connect_timeout_s=2.0, request_timeout_s=5.0)
        bodies = []
        for _ in range(3):
            async with await pool.request(server.key, *post()) as response:
                bodies.append((response.status, response.content_length, await response.read_all()))
        assert bodies == [
            (200, None, b"data: a\n\ndata: b\n\n"),
            (200, 8, b'{"a": 1}'),
            (200, None, b"data: a\n\ndata: b\n\n"),
        ]
        assert server.connections == 1
        assert server.requests[0] == (
            b"POST /v1/completions HTTP/1.1\r\nHost: engine:8000\r\nContent-Length: 2\r\n\r\n{}"
        )
        pool.close()


async def test_chunks_arrive_as_sent_and_the_write_callback_fires_before_any_answer():
    gate = asyncio.Event()

    async def then(reader, writer):
        await gate.wait()
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await reader.read()

    async with await serve(first_chunk_then(then)) as server:
        pool = UpstreamPool(2.0, 5.0)
        written = []
        async with await pool.request(
            server.key, *post(), on_written=lambda: written.append(server.requests[:])
        ) as response:
            assert written == [[]]  # the callback ran when the request was written, before the server read it
            assert await response.read_chunk() == b"first"
            gate.set()
            assert await response.read_chunk() == b"second"
            assert await response.read_chunk() == b""
        pool.close()


async def test_a_pooled_connection_closed_while_idle_is_retried_once_on_a_new_one():
    def make(server: RawServer) -> Handler:
        async def handle(reader, writer):
            await server.read_request(reader)
            writer.write(JSON_OK)
            await writer.drain()
            if server.connections == 1:
                await server.read_request(reader)  # the engine reads the next request's bytes, then drops it
                writer.transport.abort()
                return
            await reader.read()

        return handle

    async with await serve(make) as server:
        pool = UpstreamPool(2.0, 5.0)
        for _ in range(2):
            async with await pool.request(server.key, *post()) as response:
                assert await response.read_all() == b'{"a": 1}'
        assert server.connections == 2
        pool.close()


async def test_failures_before_any_byte_raise_for_the_proxy_to_retry_elsewhere():
    pool = UpstreamPool(connect_timeout_s=1.0, request_timeout_s=0.2)
    async with await serve(answering()) as silent:  # reads nothing, answers nothing
        with pytest.raises(UpstreamTimeout):
            await pool.request(silent.key, *post())
    with pytest.raises(UpstreamError, match="cannot connect"):
        await pool.request(silent.key, *post())  # the server is gone: refused
    async with await serve(answering(b"NOT HTTP\r\n\r\n")) as garbled:
        with pytest.raises(UpstreamError, match="malformed"):
            await pool.request(garbled.key, *post())


async def test_a_body_cut_short_is_an_error_and_a_body_ended_by_close_is_complete():
    cut = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial"
    until_close = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nthe whole body"

    def closing_after(response: bytes) -> Callable[[RawServer], Handler]:
        def make(server: RawServer) -> Handler:
            async def handle(reader, writer):
                await server.read_request(reader)
                writer.write(response)
                await writer.drain()

            return handle

        return make

    pool = UpstreamPool(2.0, 5.0)
    async with await serve(closing_after(cut)) as server, await pool.request(server.key, *post()) as response:
        assert await response.read_chunk() == b"partial"
        with pytest.raises(UpstreamError, match="before the response ended"):
            await response.read_chunk()
    async with await serve(closing_after(until_close)) as server:
        async with await pool.request(server.key, *post()) as response:
            assert await response.read_all() == b"the whole body"
        assert pool._take_idle(server.key) is None  # never kept: the server closed it


async def test_a_response_left_unread_closes_its_connection_and_the_server_sees_it():
    closed = asyncio.Event()

    async def then(reader, writer):
        await reader.read()  # returns when the client closes
        closed.set()

    async with await serve(first_chunk_then(then)) as server:
        pool = UpstreamPool(2.0, 5.0)
        async with await pool.request(server.key, *post()) as response:
            assert await response.read_chunk() == b"first"
        await asyncio.wait_for(closed.wait(), 2.0)
        assert pool._take_idle(server.key) is None


async def test_client_headers_pass_through_as_raw_bytes_without_hop_by_hop_ones():
    raw = [
        (b"Content-Type", b"application/json"),
        (b"Connection", b"keep-alive"),
        (b"X-Note", b"caf\xc3\xa9"),
        (b"Host", b"router:80"),
        (b"Content-Length", b"2"),
        (b"Authorization", b"Bearer t"),
    ]
    async with await serve(answering(JSON_OK)) as server:
        pool = UpstreamPool(2.0, 5.0)
        async with await pool.request(server.key, *post(headers=forward_raw_headers(raw))) as response:
            await response.read_all()
        assert server.requests[0] == (
            b"POST /v1/completions HTTP/1.1\r\nHost: engine:8000\r\nContent-Length: 2\r\n"
            b"Content-Type: application/json\r\nX-Note: caf\xc3\xa9\r\n"
            b"Authorization: Bearer t\r\n\r\n{}"
        )
        pool.close()


def test_replica_urls_give_connection_keys():
    assert upstream_key("http://10.0.0.7:8000") == ("10.0.0.7", 8000, False)
    assert upstream_key("https://engine.ns.svc") == ("engine.ns.svc", 443, True)
    assert upstream_key("http://[::1]:9000") == ("::1", 9000, False)
    with pytest.raises(ValueError, match="http"):
        upstream_key("grpc://engine:9000")


async def test_a_preconnected_connection_carries_the_first_request():
    async with await serve(answering(JSON_OK)) as server:
        pool = UpstreamPool(2.0, 5.0)
        pool.preconnect(server.key)
        pool.preconnect(server.key)  # one is opening already: no second one
        await idle_connections(pool, server.key, 1)
        assert server.connections == 1 and server.requests == []
        async with await pool.request(server.key, *post()) as response:
            assert await response.read_all() == b'{"a": 1}'
        assert server.connections == 1
        pool.close()


async def test_a_spare_connection_is_opened_when_the_last_idle_one_is_taken():
    release = asyncio.Event()

    def make(server: RawServer) -> Handler:
        async def handle(reader, writer):
            while True:
                await server.read_request(reader)
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked"
                    b"\r\n\r\n5\r\nfirst\r\n"
                )
                await writer.drain()
                await release.wait()  # a long stream: its connection stays busy until the test says
                writer.write(b"0\r\n\r\n")
                await writer.drain()

        return handle

    async with await serve(make) as server:
        pool = UpstreamPool(2.0, 5.0, keep_spare=True)
        first = await pool.request(server.key, *post())  # nothing idle: it connects, then a spare opens
        await idle_connections(pool, server.key, 1)
        assert server.connections == 2
        second = await pool.request(server.key, *post())  # rides the spare; the next spare opens
        await idle_connections(pool, server.key, 1)
        assert server.connections == 3 and len(server.requests) == 2
        release.set()
        for response in (first, second):
            async with response:
                assert await response.read_all() == b"first"
        assert len(pool._idle[server.key]) == 3  # both came back; no fourth connection was opened
        assert server.connections == 3
        pool.close()


async def test_closing_the_pool_closes_its_idle_connections():
    closed = asyncio.Event()

    def make(server: RawServer) -> Handler:
        async def handle(reader, writer):
            await server.read_request(reader)
            writer.write(JSON_OK)
            await reader.read()  # returns when the client closes
            closed.set()

        return handle

    async with await serve(make) as server:
        pool = UpstreamPool(2.0, 5.0)
        async with await pool.request(server.key, *post()) as response:
            await response.read_all()
        assert len(pool._idle[server.key]) == 1
        pool.close()
        await asyncio.wait_for(closed.wait(), 2.0)
        assert pool._take_idle(server.key) is None


async def test_a_discarded_server_keeps_no_connections_until_it_is_used_again():
    async with await serve(answering(JSON_OK, JSON_OK, JSON_OK)) as server:
        pool = UpstreamPool(2.0, 5.0)
        pool.preconnect(server.key)
        await idle_connections(pool, server.key, 1)
        idle = pool._idle[server.key][0]
        busy = await pool.request(server.key, *post())  # takes the idle one: the pool keeps no entry for it
        assert busy is idle and server.key not in pool._idle
        pool.discard(server.key)
        await busy.read_all()
        busy.release()  # its response ended after the discard: closed, not pooled
        assert busy._transport.is_closing() and server.key not in pool._idle
        async with await pool.request(server.key, *post()) as again:  # used again: pooled again
            assert await again.read_all() == b'{"a": 1}'
        assert pool._idle[server.key] == [again] and server.connections == 2
        pool.discard(server.key)
        assert server.key not in pool._idle and again._transport.is_closing()
        pool.close()


def test_discarded_servers_are_remembered_only_as_long_as_a_request_there_can_last(monkeypatch):
    import kvpilot.router.upstream as upstream

    now = [1000.0]
    monkeypatch.setattr(upstream.time, "monotonic", lambda: now[0])
    pool = UpstreamPool(connect_timeout_s=1.0, request_timeout_s=10.0)
    first, second = upstream_key("http://10.0.0.1:8000"), upstream_key("http://10.0.0.2:8000")
    pool.discard(first)
    now[0] += 11.0  # within connect + request timeout of the first discard: still remembered
    pool.discard(second)
    assert set(pool._discarded) == {first, second}
    now[0] += 0.5  # 11.5 s after the first: no request there can still be running
    pool.discard(second)
    assert set(pool._discarded) == {second}
