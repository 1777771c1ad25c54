"""The router's upstream client (aiohttp, a session per replica) against raw TCP servers: framing (chunked,
length, until close), keep-alive reuse, the one silent retry of a pooled connection closed while idle,
headers passed as the client sent them, connections closed when a replica leaves, and every failure mode the
proxy turns into a retry or a broken response."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from multidict import CIMultiDict

from kvpilot.router.proxy import forward_headers
from kvpilot.router.upstream import UpstreamClient, UpstreamError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
CHUNKED_SSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"9\r\ndata: a\n\n\r\n9\r\ndata: b\n\n\r\n0\r\n\r\n"
)
JSON_OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 8\r\n\r\n{"a": 1}'
PATH = "/v1/completions"


class RawServer:
    """A TCP server whose ``handler`` sees each connection; counts connections (open ones too) and keeps the
    requests."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self.connections = 0
        self.open = 0
        self.requests: list[bytes] = []
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        try:
            await self._handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client went away, or the test ended
        finally:
            self.open -= 1
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


def request(client: UpstreamClient, server: RawServer, body: bytes = b"{}", headers=None, **kwargs):
    return client.request(server.url, "POST", PATH, CIMultiDict(headers or {}), body, **kwargs)


async def until(condition: Callable[[], bool], timeout_s: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


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
    """A handler that reads one request, starts a chunked answer with the chunk ``first``, then runs
    ``then``."""

    def make(server: RawServer) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            await then(reader, writer)

        return handle

    return make


def gated(gate: asyncio.Event, rest: bytes) -> Handler:
    """The rest of a chunked answer, written once ``gate`` is set; then the connection stays open."""

    async def then(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await gate.wait()
        writer.write(rest)
        await reader.read()

    return then


async def serve(make: Callable[[RawServer], Handler]) -> RawServer:
    server = RawServer(lambda r, w: handler(r, w))
    handler = make(server)
    return server


async def test_keep_alive_reuses_one_connection_for_chunked_and_sized_bodies():
    async with await serve(answering(CHUNKED_SSE, JSON_OK, CHUNKED_SSE)) as server:
        client = UpstreamClient(connect_timeout_s=2.0, request_timeout_s=5.0)
        bodies = []
        for _ in range(3):
            async with request(client, server) as response:
                bodies.append((response.status, response.content_length, await response.read()))
        assert bodies == [
            (200, None, b"data: a\n\ndata: b\n\n"),
            (200, 8, b'{"a": 1}'),
            (200, None, b"data: a\n\ndata: b\n\n"),
        ]
        assert server.connections == 1
        host = server.url.removeprefix("http://").encode()
        assert server.requests[0] == (
            b"POST /v1/completions HTTP/1.1\r\nHost: " + host + b"\r\nContent-Length: 2\r\n\r\n{}"
        )
        await client.close()


async def test_chunks_arrive_as_sent_and_the_write_callback_fires_before_any_answer():
    gate = asyncio.Event()
    async with await serve(first_chunk_then(gated(gate, b"6\r\nsecond\r\n0\r\n\r\n"))) as server:
        client = UpstreamClient(2.0, 5.0)
        written = []
        async with request(client, server, on_written=lambda: written.append(server.requests[:])) as response:
            assert written == [[]]  # it ran as the request went out, before the server read it; once
            assert await response.content.readany() == b"first"
            gate.set()
            assert await response.content.readany() == b"second"
            assert await response.content.readany() == b""
        await client.close()


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
        client = UpstreamClient(2.0, 5.0)
        for _ in range(2):
            async with request(client, server) as response:
                assert await response.read() == b'{"a": 1}'
        assert server.connections == 2
        await client.close()


async def test_a_fresh_connection_dropped_after_the_request_is_never_sent_the_request_again():
    """The engine read the request on a new connection and closed it unanswered: it may have run it, so
    re-sending the POST could run it twice; only a reused keep-alive connection is retried."""

    def make(server: RawServer) -> Handler:
        async def handle(reader, writer):
            await server.read_request(reader)  # reads it, then closes without an answer

        return handle

    async with await serve(make) as server:
        client = UpstreamClient(2.0, 5.0)
        written = []
        with pytest.raises(aiohttp.ServerDisconnectedError):
            async with request(client, server, on_written=lambda: written.append(1)):
                pass
        assert (len(server.requests), server.connections, written) == (1, 1, [1])
        await client.close()


async def test_failures_before_any_byte_raise_for_the_proxy_to_retry_elsewhere():
    client = UpstreamClient(connect_timeout_s=1.0, request_timeout_s=0.2)
    async with await serve(answering()) as silent:  # reads nothing, answers nothing
        with pytest.raises(TimeoutError):
            async with request(client, silent):
                pass
    with pytest.raises(UpstreamError):
        async with request(client, silent):  # the server is gone: refused
            pass
    async with await serve(answering(b"NOT HTTP\r\n\r\n")) as garbled:
        with pytest.raises(UpstreamError):
            async with request(client, garbled):
                pass
    await client.close()


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

    client = UpstreamClient(2.0, 5.0)
    async with await serve(closing_after(cut)) as server, request(client, server) as response:
        assert await response.content.readany() == b"partial"
        with pytest.raises(UpstreamError):
            await response.content.readany()
    async with await serve(closing_after(until_close)) as server, request(client, server) as response:
        assert await response.read() == b"the whole body"
    await client.close()


async def test_a_response_left_unread_closes_its_connection_and_the_server_sees_it():
    closed = asyncio.Event()

    async def then(reader, writer):
        await reader.read()  # returns when the client closes
        closed.set()

    async with await serve(first_chunk_then(then)) as server:
        client = UpstreamClient(2.0, 5.0)
        async with request(client, server) as response:
            assert await response.content.readany() == b"first"
        await asyncio.wait_for(closed.wait(), 2.0)
        await client.close()


async def test_client_headers_pass_through_without_hop_by_hop_ones_or_a_clients_router_token():
    incoming = CIMultiDict(
        [
            ("Content-Type", "application/json"),
            ("Connection", "keep-alive"),
            ("X-Note", "café"),
            ("Host", "router:80"),
            ("Content-Length", "2"),
            ("Authorization", "Bearer t"),
            ("X-Kvpilot-Router-Token", "forged"),
        ]
    )
    async with await serve(answering(JSON_OK, JSON_OK)) as server:
        client = UpstreamClient(2.0, 5.0)
        for vouch in (None, "secret"):
            async with request(client, server, headers=forward_headers(incoming, vouch)) as response:
                await response.read()
        host = server.url.removeprefix("http://").encode()
        expected = (
            b"POST /v1/completions HTTP/1.1\r\nHost: " + host + b"\r\n"
            b"Content-Type: application/json\r\nX-Note: caf\xc3\xa9\r\nAuthorization: Bearer t\r\n"
        )
        assert server.requests[0] == expected + b"Content-Length: 2\r\n\r\n{}"
        assert server.requests[1] == (
            expected + b"x-kvpilot-router-token: secret\r\nContent-Length: 2\r\n\r\n{}"
        )
        await client.close()


async def test_a_replica_that_leaves_keeps_its_connections_until_its_last_request_ends():
    gate = asyncio.Event()
    async with await serve(first_chunk_then(gated(gate, b"0\r\n\r\n"))) as server:
        client = UpstreamClient(2.0, 5.0)
        async with request(client, server) as response:
            assert await response.content.readany() == b"first"
            client.forget(server.url)  # discovery dropped it mid-stream: the stream still finishes
            assert client.replicas == {server.url}
            gate.set()
            assert await response.read() == b""
        await until(lambda: server.open == 0)
        assert client.replicas == set()
        await client.close()


async def test_a_replica_that_leaves_while_idle_has_its_connections_closed():
    async with await serve(answering(JSON_OK)) as server:
        client = UpstreamClient(2.0, 5.0)
        async with request(client, server) as response:
            await response.read()
        assert server.open == 1  # kept alive
        client.forget(server.url)
        await until(lambda: server.open == 0)
        assert client.replicas == set()
        await client.close()


async def test_closing_the_client_closes_its_idle_connections():
    async with await serve(answering(JSON_OK)) as server:
        client = UpstreamClient(2.0, 5.0)
        async with request(client, server) as response:
            await response.read()
        await client.close()
        await until(lambda: server.open == 0)
