"""The activator of a service scaled to zero: held requests are released to the first Ready replica and
answered in full; past the queue or the hold timeout they get a 503 with Retry-After; /metrics says what
the autoscaler reads (held now, held in all)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import socket
from collections.abc import AsyncIterator

import aiohttp
import aiohttp.web

from kvpilot.operator.activator import Activator, ActivatorConfig
from kvpilot.operator.signals import parse_activator_metrics


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _serve(app: aiohttp.web.Application, port: int) -> aiohttp.web.AppRunner:
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def _router_app() -> aiohttp.web.Application:
    """A replica's router: echoes the request's path and body, streamed in two chunks; ``/v1/packed``
    answers a gzip-encoded body."""

    async def complete(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        body = await request.json()
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(b'{"path": "' + request.path.encode() + b'", ')
        await response.write(f'"prompt": "{body["prompt"]}"}}'.encode())
        await response.write_eof()
        return response

    async def packed(request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(
            body=gzip.compress(b"packed", mtime=0), headers={"Content-Encoding": "gzip"}
        )

    app = aiohttp.web.Application(client_max_size=16 << 20)  # as large as the real router takes
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/v1/packed", packed)
    return app


@contextlib.asynccontextmanager
async def _serving(config: ActivatorConfig, ready: list[str]) -> AsyncIterator[tuple[str, str]]:
    """The activator (its lookup answers ``ready`` as it is then) and a live router: their base URLs."""

    async def upstreams() -> list[str]:
        return list(ready)

    activator_port, upstream_port = _port(), _port()
    runner = Activator(config, upstreams).runner()  # as `kvpilot operator activator` serves it
    await runner.setup()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", activator_port).start()
    router = await _serve(_router_app(), upstream_port)
    try:
        yield f"http://127.0.0.1:{activator_port}", f"http://127.0.0.1:{upstream_port}"
    finally:
        await runner.cleanup()
        await router.cleanup()


async def _scenario() -> dict:
    ready: list[str] = []
    config = ActivatorConfig(
        namespace="ml", name="smol", queue_size=3, hold_timeout_seconds=1.5, poll_seconds=0.05
    )
    results: dict = {}
    async with _serving(config, ready) as (base, live), aiohttp.ClientSession() as client:

        async def complete(prompt: str) -> tuple[int, str, str | None]:
            async with client.post(f"{base}/v1/completions", json={"prompt": prompt}) as response:
                return response.status, await response.text(), response.headers.get("Retry-After")

        # Four arrive at zero replicas: three are held, the fourth is past the queue.
        held = [asyncio.create_task(complete(f"p{i}")) for i in range(3)]
        await asyncio.sleep(0.3)
        results["full"] = await complete("p3")
        async with client.get(f"{base}/metrics") as response:
            results["metrics_held"] = parse_activator_metrics(await response.text())
        ready.append(live)  # a replica turns Ready
        results["released"] = await asyncio.gather(*held)
        results["direct"] = await complete("p4")  # a replica is there: straight through
        ready.clear()
        await asyncio.sleep(0.2)
        results["timeout"] = await complete("p5")  # nobody comes back within 1.5 s
        async with client.get(f"{base}/metrics") as response:
            text = await response.text()
        results["metrics_after"] = parse_activator_metrics(text)
        results["ttft_count"] = next(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("kvpilot_activator_cold_start_ttft_seconds_count")
        )
    return results


def test_held_requests_are_released_to_the_first_ready_replica_or_refused_with_retry_after():
    results = asyncio.run(_scenario())
    status, body, retry = results["full"]
    assert (status, retry) == (503, "10")
    assert '"code": "queue_full"' in body
    assert results["metrics_held"] == (3.0, 3.0)
    assert results["released"] == [
        (200, f'{{"path": "/v1/completions", "prompt": "p{i}"}}', None) for i in range(3)
    ]
    assert results["direct"] == (200, '{"path": "/v1/completions", "prompt": "p4"}', None)
    status, body, retry = results["timeout"]
    assert (status, retry) == (503, "10") and '"code": "hold_timeout"' in body
    # held in all: the three released and the one that timed out (the refused one was never held)
    assert results["metrics_after"] == (0.0, 4.0)
    assert results["ttft_count"] == 3.0  # cold-start TTFT of the three released, apart from the rest


async def _stale_scenario() -> dict:
    """The lookup still lists a replica whose router is gone (nothing listens on its port)."""
    ready = [f"http://127.0.0.1:{_port()}"]
    config = ActivatorConfig(namespace="ml", name="smol", hold_timeout_seconds=5.0, poll_seconds=0.05)
    results: dict = {}
    async with _serving(config, ready) as (base, live), aiohttp.ClientSession() as client:

        async def complete(prompt: str) -> tuple[int, str]:
            async with client.post(f"{base}/v1/completions", json={"prompt": prompt}) as response:
                return response.status, await response.text()

        await asyncio.sleep(0.2)  # the first lookup has listed the dead replica
        # refused by the dead replica, so held until a live one is listed
        pending = [asyncio.create_task(complete(f"q{i}")) for i in range(3)]
        await asyncio.sleep(0.3)
        results["held_while_only_dead"] = [task.done() for task in pending]
        ready.append(live)
        results["answered"] = await asyncio.gather(*pending)
        results["next"] = await complete("q3")  # dead and live both listed: the live one answers
    return results


def test_a_replica_that_refuses_connections_is_skipped_and_the_request_held_for_a_live_one():
    results = asyncio.run(_stale_scenario())
    assert results["held_while_only_dead"] == [False, False, False]
    assert results["answered"] == [
        (200, f'{{"path": "/v1/completions", "prompt": "q{i}"}}') for i in range(3)
    ]
    assert results["next"] == (200, '{"path": "/v1/completions", "prompt": "q3"}')


def _failing_router_app() -> aiohttp.web.Application:
    """A replica's router that takes each request and fails it: ``/v1/completions`` drops the connection
    before answering, ``/v1/chat/completions`` after one SSE event."""

    async def drop(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        await request.read()
        assert request.transport is not None
        request.transport.close()
        return aiohttp.web.Response()  # never sent: the connection is gone

    async def drop_mid_stream(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\n')
        assert request.transport is not None
        request.transport.close()
        return response

    app = aiohttp.web.Application()
    app.router.add_post("/v1/completions", drop)
    app.router.add_post("/v1/chat/completions", drop_mid_stream)
    return app


async def _failing_scenario() -> dict:
    port = _port()
    failing = await _serve(_failing_router_app(), port)
    config = ActivatorConfig(namespace="ml", name="smol", hold_timeout_seconds=5.0, poll_seconds=0.05)
    results: dict = {}
    try:
        async with (
            _serving(config, [f"http://127.0.0.1:{port}"]) as (base, _),
            aiohttp.ClientSession() as client,
        ):
            await asyncio.sleep(0.2)  # the first lookup has listed the failing replica
            async with client.post(f"{base}/v1/completions", json={"prompt": "x"}) as response:
                results["before"] = response.status, await response.json()
            async with client.post(f"{base}/v1/chat/completions", json={"messages": []}) as response:
                results["mid"] = response.status, await response.text()
            async with client.get(f"{base}/metrics") as response:
                results["metrics"] = await response.text()
    finally:
        await failing.cleanup()
    return results


def test_a_replica_that_fails_after_taking_the_request_gets_the_client_a_502_or_an_error_event():
    results = asyncio.run(_failing_scenario())
    status, body = results["before"]
    assert status == 502 and body["error"]["code"] == "upstream_failed"
    assert body["error"]["type"] == "bad_gateway" and "smol" in body["error"]["message"]
    status, text = results["mid"]
    events = [line for line in text.split("\n\n") if line]
    assert status == 200 and events[0] == 'data: {"choices": [{"delta": {"content": "Hi"}}]}'
    assert '"code":"upstream_failed"' in events[1] and events[2] == "data: [DONE]"
    assert len(events) == 3
    assert "kvpilot_activator_upstream_failures_total 2.0" in results["metrics"]


async def _encoding_scenario() -> dict:
    """Bodies with a Content-Encoding, both ways, as the router's proxy passes them."""
    packed = gzip.compress(b'{"prompt": "zipped"}')
    ready: list[str] = []
    config = ActivatorConfig(namespace="ml", name="smol", hold_timeout_seconds=5.0, poll_seconds=0.05)
    results: dict = {}
    async with _serving(config, ready) as (base, live), aiohttp.ClientSession() as client:
        ready.append(live)
        gzipped = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        async with client.post(f"{base}/v1/completions", data=packed, headers=gzipped) as response:
            results["gzip"] = response.status, await response.text()
        async with client.post(f"{base}/v1/completions", data=b"not gzip", headers=gzipped) as response:
            results["corrupt"] = response.status, await response.json()
        async with client.post(f"{base}/v1/completions", json={"prompt": "after"}) as response:
            results["after"] = response.status, await response.text()
        async with client.get(f"{base}/v1/packed", auto_decompress=False) as response:
            results["answer"] = response.headers.get("Content-Encoding"), await response.read()
    return results


def test_encoded_bodies_are_forwarded_as_the_router_forwards_them():
    results = asyncio.run(_encoding_scenario())
    # the request body goes on decoded, without the Content-Encoding that no longer describes it
    assert results["gzip"] == (200, '{"path": "/v1/completions", "prompt": "zipped"}')
    status, body = results["corrupt"]  # one that does not decode is the client's error, not a 500
    assert (status, body["error"]["code"], body["error"]["type"]) == (
        400,
        "invalid_encoding",
        "invalid_request_error",
    )
    assert results["after"] == (200, '{"path": "/v1/completions", "prompt": "after"}')
    # an encoded answer passes byte for byte with its header
    assert results["answer"] == ("gzip", gzip.compress(b"packed", mtime=0))


async def _bodies_scenario() -> dict:
    """Bodies a warm service's router takes or refuses, sent while it is at zero."""
    ready: list[str] = []
    config = ActivatorConfig(namespace="ml", name="smol", hold_timeout_seconds=5.0, poll_seconds=0.05)
    results: dict = {}
    async with _serving(config, ready) as (base, live), aiohttp.ClientSession() as client:
        ready.append(live)
        large = json.dumps({"prompt": "x" * (2 << 20)}).encode()  # past aiohttp's 1 MiB default
        async with client.post(f"{base}/v1/completions", data=large) as response:
            results["2 MiB"] = response.status, len(await response.read())
        too_large = json.dumps({"prompt": "x" * (9 << 20)}).encode()
        async with client.post(f"{base}/v1/completions", data=too_large) as response:
            results["9 MiB"] = response.status, (await response.json())["error"]["code"]
        cut = gzip.compress(b'{"prompt": "zipped"}')[:12]
        headers = {"Content-Encoding": "gzip"}
        async with client.post(f"{base}/v1/completions", data=cut, headers=headers) as response:
            results["cut gzip"] = response.status, (await response.json())["error"]["code"]
        for coding in ("br", "compress"):
            headers = {"Content-Encoding": coding}
            async with client.post(f"{base}/v1/completions", data=b"{}", headers=headers) as response:
                error = (await response.json())["error"]
                results[coding] = response.status, error["code"], response.headers.get("Accept-Encoding")
        reader, writer = await asyncio.open_connection("127.0.0.1", int(base.rsplit(":", 1)[1]))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
        head, _, body = (await reader.read()).partition(b"\r\n\r\n")  # until the activator closes
        writer.close()
    results["malformed"] = head.split(b" ")[1], json.loads(body)["error"]["code"]
    return results


def test_bodies_are_read_as_a_replicas_router_reads_them():
    results = asyncio.run(_bodies_scenario())
    assert results == {
        "2 MiB": (200, 2 * 1024 * 1024 + len('{"path": "/v1/completions", "prompt": ""}')),
        "9 MiB": (413, "request_too_large"),
        "cut gzip": (400, "invalid_encoding"),
        "br": (415, "unsupported_encoding", "gzip, deflate"),
        "compress": (415, "unsupported_encoding", "gzip, deflate"),
        "malformed": (b"400", "invalid_http_request"),
    }
