"""Failure handling: eject at once, retry once elsewhere before the first byte, the client gets errors after
it, re-admission, resync after an engine restart, and no lost request when an engine dies mid-run."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from kvpilot.router.endpointslices import Endpoint
from kvpilot.router.proxy import REPLICA_HEADER
from kvpilot.router.sse_events import HELD_EVENT_BYTES

SLOW = {"queued_prefill_tokens": 1_000_000}  # /load override: this replica looks far slower (chosen second)


def sample(router, name: str, **labels: str) -> float:
    value = router.router.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def completion(text: str = "hello there", stream: bool = True) -> dict:
    return {"prompt": text, "max_tokens": 4, "stream": stream}


async def test_a_503_before_the_first_byte_is_retried_elsewhere_and_ejects(
    fake_engines, routers, http, until
):
    failing, healthy = await fake_engines(2)
    healthy.behavior.load = SLOW
    failing.behavior.inference_status = 503
    router = await routers([failing.url, healthy.url])
    async with http.post(router.url + "/v1/completions", json=completion()) as response:
        assert (response.status, response.headers[REPLICA_HEADER]) == (200, healthy.url)
        assert (await response.read()).endswith(b"data: [DONE]\n\n")
    assert len(failing.received) == len(healthy.received) == 1
    assert sample(router, "kvpilot_router_retries_total") == 1
    assert sample(router, "kvpilot_router_ejections_total", replica=failing.url, reason="not_ready") == 1
    assert sample(router, "kvpilot_router_decisions_total", policy="cache_aware", reason="cold") == 2
    # Its /load still says ready, so the next poll sent after the ejection re-admits it.
    await until(lambda: len(router.router.fleet.routable()) == 2)


async def test_a_dead_replica_is_retried_elsewhere_and_stays_ejected(fake_engines, routers, http, until):
    dead, healthy = await fake_engines(2)
    healthy.behavior.load = SLOW
    router = await routers([dead.url, healthy.url], poll_interval_s=30.0)  # polls cannot notice first
    await dead.crash()
    async with http.post(router.url + "/v1/completions", json=completion(stream=False)) as response:
        assert (response.status, response.headers[REPLICA_HEADER]) == (200, healthy.url)
    assert sample(router, "kvpilot_router_ejections_total", replica=dead.url, reason="error") == 1
    assert [r.url for r in router.router.fleet.routable()] == [healthy.url]


async def test_a_replica_that_stops_being_ready_or_answers_load_too_slowly_is_ejected(
    fake_engines, routers, http, until
):
    draining, slow, healthy = await fake_engines(3)
    router = await routers([draining.url, slow.url, healthy.url])
    draining.behavior.ready = False
    slow.behavior.load_delay_s = 1.0  # the routers' poll timeout is 0.5 s
    await until(lambda: [r.url for r in router.router.fleet.routable()] == [healthy.url])
    assert sample(router, "kvpilot_router_ejections_total", replica=draining.url, reason="not_ready") == 1
    assert sample(router, "kvpilot_router_ejections_total", replica=slow.url, reason="timeout") == 1
    for _ in range(3):
        async with http.post(router.url + "/v1/completions", json=completion(stream=False)) as response:
            assert response.headers[REPLICA_HEADER] == healthy.url
    draining.behavior.ready, slow.behavior.load_delay_s = True, 0.0
    await until(lambda: len(router.router.fleet.routable()) == 3)  # re-admitted once ready and prompt


async def test_when_every_try_fails_the_client_gets_the_last_answer_or_a_502(fake_engines, routers, http):
    first, second = await fake_engines(2, inference_status=503)
    second.behavior.load = SLOW
    router = await routers([first.url, second.url])
    async with http.post(router.url + "/v1/completions", json=completion()) as response:
        assert (response.status, response.headers[REPLICA_HEADER]) == (503, second.url)
        assert (await response.json())["error"]["message"] == "fake failure"  # the engine's own body
    router = await routers([first.url, second.url], poll_interval_s=30.0)
    await first.crash()
    await second.crash()
    async with http.post(router.url + "/v1/completions", json=completion()) as response:
        body = await response.json()
        assert (response.status, body["error"]["code"], body["error"]["type"]) == (
            502,
            "upstream_failed",
            "bad_gateway",
        )
    assert sample(router, "kvpilot_router_retries_total") == 1  # one retry, never more


def data_lines(received: bytes) -> list[str]:
    return [line[6:] for line in received.decode().split("\n\n") if line.startswith("data: ")]


MID_STREAM_ERROR = {
    "error": {
        "message": "an upstream replica failed mid-response: its connection broke",
        "type": "bad_gateway",
        "param": None,
        "code": "upstream_failed",
    }
}


async def test_a_replica_dying_mid_stream_ends_it_with_an_error_event_then_done(
    fake_engines, routers, http, until
):
    (engine,) = await fake_engines(1, output_tokens=50, token_delay_s=0.05)
    router = await routers([engine.url])
    async with http.post(router.url + "/v1/completions", json=completion()) as response:
        assert response.status == 200
        received = await response.content.readany()
        await engine.crash()
        received += await response.read()  # ends as a complete body (a ClientPayloadError otherwise)
    data = data_lines(received)
    assert json.loads(data[0]) == {"choices": [{"text": "t0"}]}
    assert [json.loads(data[-2]), data[-1]] == [MID_STREAM_ERROR, "[DONE]"]  # as the engine ends a failed one
    assert received.endswith(b"\n\ndata: [DONE]\n\n") and received.count(b"[DONE]") == 1
    assert sample(router, "kvpilot_router_retries_total") == 0
    await until(lambda: not router.router.fleet.routable())


async def test_an_event_the_replica_left_half_written_is_dropped_before_the_error(
    fake_engines, routers, http
):
    (engine,) = await fake_engines(1, output_tokens=2, tear_stream=True)
    router = await routers([engine.url])
    async with http.post(router.url + "/v1/completions", json=completion()) as response:
        received = await response.read()
    assert received == (
        b'data: {"choices": [{"text": "t0"}]}\n\ndata: {"choices": [{"text": "t1"}]}\n\n'
        b"data: " + json.dumps(MID_STREAM_ERROR, separators=(",", ":")).encode() + b"\n\ndata: [DONE]\n\n"
    )


async def test_no_ready_replica_is_a_503_with_retry_after_one_poll(fake_engines, routers, http):
    (engine,) = await fake_engines(1, ready=False)
    for interval, retry_after in ((0.02, "1"), (2.5, "3")):
        router = await routers([engine.url], ready=0, poll_interval_s=interval)
        async with http.post(router.url + "/v1/completions", json=completion()) as response:
            assert (response.status, response.headers.get("Retry-After"), await response.json()) == (
                503,
                retry_after,
                {
                    "error": {
                        "message": "no engine replica is ready",
                        "type": "service_unavailable",
                        "param": None,
                        "code": "no_ready_replica",
                    }
                },
            )


async def test_security_a_502_names_the_replica_by_pod_never_by_address(fake_engines, routers, http):
    unnamed, named = await fake_engines(2)
    named.behavior.load = SLOW  # tried second: the 502 is about it
    router = await routers([unnamed.url, named.url], poll_interval_s=30.0)
    fleet = router.router.fleet
    fleet.set_endpoints([Endpoint(unnamed.url), Endpoint(named.url, None, "kvpilot-engine-6d9f-1")])
    assert (fleet.replicas[unnamed.url].pod, fleet.replicas[named.url].pod) == (None, "kvpilot-engine-6d9f-1")
    lone = await routers([unnamed.url], poll_interval_s=30.0)
    await unnamed.crash()
    await named.crash()
    for server, name, header in (
        (router, "engine replica kvpilot-engine-6d9f-1", "kvpilot-engine-6d9f-1"),
        (lone, "an upstream replica", unnamed.url),  # configured by URL: named by that URL
    ):
        async with http.post(server.url + "/v1/completions", json=completion()) as response:
            raw = await response.read()
            assert response.headers[REPLICA_HEADER] == header
            assert (response.status, json.loads(raw)) == (
                502,
                {
                    "error": {
                        "message": f"{name} failed before answering: its connection failed",
                        "type": "bad_gateway",
                        "param": None,
                        "code": "upstream_failed",
                    }
                },
            )
        assert b"127.0.0.1" not in raw and str(unnamed.port).encode() not in raw
        assert str(named.port).encode() not in raw


async def test_security_an_answer_names_its_replica_by_pod_never_by_address(fake_engines, routers, http):
    (engine,) = await fake_engines(1)
    router = await routers([engine.url])
    router.router.fleet.set_endpoints([Endpoint(engine.url, None, "kvpilot-engine-6d9f-2")])
    async with http.post(router.url + "/v1/completions", json=completion(stream=False)) as response:
        assert (response.status, response.headers[REPLICA_HEADER]) == (200, "kvpilot-engine-6d9f-2")


async def test_a_client_that_leaves_cancels_the_upstream_request(fake_engines, routers, until):
    (engine,) = await fake_engines(1, hang=True)
    router = await routers([engine.url])
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as impatient:
        try:
            async with impatient.post(router.url + "/v1/completions", json=completion()) as response:
                await response.read()
        except TimeoutError:
            pass
    await until(lambda: engine.cancelled == 1)
    await until(lambda: not router.router.fleet.replicas[engine.url].in_flight)
    assert sample(router, "kvpilot_router_in_flight_requests", replica=engine.url) == 0


async def test_an_engine_restart_resyncs_the_prefix_index(fake_engines, routers, http, until):
    (engine,) = await fake_engines(1)
    router = await routers([engine.url])
    replica = router.router.fleet.replicas[engine.url]
    async with http.post(router.url + "/v1/completions", json=completion("a prompt " * 20)) as response:
        await response.read()
    await until(lambda: replica.index.hashes == set(engine.cached) and replica.index.seq == 1)
    old_epoch = replica.index.epoch
    engine.restart()
    await until(lambda: replica.index.epoch == engine.epoch and replica.index.synced)
    assert replica.index.epoch != old_epoch and replica.index.hashes == set()
    assert sample(router, "kvpilot_router_kv_resyncs_total", replica=engine.url) == 2  # start + restart


async def test_an_engine_dying_mid_run_loses_no_request_that_had_not_started_streaming(
    fake_engines, routers, until
):
    engines = await fake_engines(3, first_byte_s=0.15, output_tokens=6, token_delay_s=0.03)
    first, second = await routers([e.url for e in engines]), await routers([e.url for e in engines])
    victim = engines[0]
    outcomes: dict[str, str] = {}

    async def client(i: int, session: aiohttp.ClientSession) -> None:
        router = (first, second)[i % 2]
        await asyncio.sleep(0.01 * i)
        try:
            async with session.post(
                router.url + "/v1/completions",
                json=completion(f"request {i} " * 5),
                headers={"x-request-id": str(i), "x-tenant": f"t{i % 5}"},
            ) as response:
                raw = await response.read()
                outcomes[str(i)] = "ok" if response.status == 200 and raw.endswith(b"[DONE]\n\n") else "bad"
        except aiohttp.ClientPayloadError:
            outcomes[str(i)] = "broken"

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        clients = [asyncio.create_task(client(i, session)) for i in range(40)]
        # kill it mid-run: once some of its requests stream and others still wait for their first byte
        await until(lambda: bool(victim.first_bytes) and victim.waiting > 0, timeout_s=10)
        await victim.crash()
        await asyncio.gather(*clients)
    lost = {i for i, outcome in outcomes.items() if outcome != "ok"}
    assert lost <= victim.first_bytes, (
        f"lost requests that had not started streaming: {lost - victim.first_bytes}"
    )
    retried = sample(first, "kvpilot_router_retries_total") + sample(second, "kvpilot_router_retries_total")
    assert retried >= 1, "the crash should have caught requests before their first byte"
    assert len(outcomes) == 40


def endless_event(monkeypatch, engine, size: int, release: asyncio.Event, then_crash: bool = False) -> None:
    """``engine`` answers a stream with one whole event, then ``size`` bytes of one event that never ends
    (no blank line), then waits for ``release``, then ends its body (or dies, ``then_crash``)."""

    async def answer(request, body, ids, cached):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"text": "t0"}]}\n\n')
        await response.write(b"data: ")
        for _ in range(size // 4096):
            await response.write(b"x" * 4096)
        await asyncio.wait_for(release.wait(), 10)
        if then_crash:
            await engine.crash()
            return response
        await response.write_eof()
        return response

    monkeypatch.setattr(engine, "_answer", answer)


async def test_an_event_longer_than_the_router_holds_is_passed_on_as_it_comes(
    fake_engines, routers, http, until, monkeypatch
):
    """The router holds an unfinished event to drop it if the replica dies, but never more than
    HELD_EVENT_BYTES of it (it held every byte of a stream without a blank line, and rescanned them all
    on each chunk): a longer event reaches the client before it ends, byte for byte."""
    (engine,) = await fake_engines(1)
    router = await routers([engine.url])
    release = asyncio.Event()
    endless_event(monkeypatch, engine, 4 * HELD_EVENT_BYTES, release)
    async with http.post(router.url + "/v1/completions", json=completion()) as response:
        received = bytearray()

        async def read_some() -> None:
            received.extend(await response.content.readany())

        while len(received) < 2 * HELD_EVENT_BYTES:  # the engine waits: all it wrote is in flight
            await asyncio.wait_for(read_some(), 5)
        release.set()
        received += await response.read()
    assert bytes(received) == b'data: {"choices": [{"text": "t0"}]}\n\ndata: ' + b"x" * (4 * HELD_EVENT_BYTES)


async def test_a_replica_dying_inside_an_event_too_long_to_hold_breaks_the_connection(
    fake_engines, routers, http, until, monkeypatch
):
    (engine,) = await fake_engines(1)
    router = await routers([engine.url])
    release = asyncio.Event()
    endless_event(monkeypatch, engine, 2 * HELD_EVENT_BYTES, release, then_crash=True)
    async with http.post(router.url + "/v1/completions", json=completion()) as response:
        received = await response.content.readexactly(len(b'data: {"choices": [{"text": "t0"}]}\n\n'))
        release.set()
        with pytest.raises(aiohttp.ClientPayloadError):  # not an error event glued to half an event
            await response.read()
    assert received == b'data: {"choices": [{"text": "t0"}]}\n\n'
    await until(lambda: not router.router.fleet.routable())


def replica_series(router, url: str) -> list[str]:
    """Every exported sample that names replica ``url``."""
    return [
        f"{sample.name}{sample.labels}"
        for family in router.router.metrics.registry.collect()
        for sample in family.samples
        if sample.labels.get("replica") == url
    ]


async def test_a_replica_removed_while_a_request_is_in_flight_leaves_no_series_behind(
    fake_engines, routers, http, until
):
    (engine,) = await fake_engines(1, hang=True)
    router = await routers([engine.url])
    fleet = router.router.fleet
    request = asyncio.ensure_future(http.post(router.url + "/v1/completions", json=completion()))
    await until(lambda: engine.waiting == 1)
    fleet.set_endpoints([])  # discovery drops it; its request goes on
    assert replica_series(router, engine.url) == []
    await engine.crash()  # the request fails there: the removed replica is not counted again
    async with await request as response:
        assert response.status == 502
    assert replica_series(router, engine.url) == []


async def test_the_in_flight_gauge_never_goes_negative_when_a_replica_is_removed_and_readded(
    fake_engines, routers, http, until
):
    (engine,) = await fake_engines(1, hang=True)
    router = await routers([engine.url])
    fleet = router.router.fleet
    in_flight = "kvpilot_router_in_flight_requests"
    request = asyncio.ensure_future(http.post(router.url + "/v1/completions", json=completion(stream=False)))
    await until(lambda: engine.waiting == 1)
    assert sample(router, in_flight, replica=engine.url) == 1
    fleet.set_endpoints([])
    fleet.set_endpoints([Endpoint(engine.url)])  # back, as a new replica: the old request is not its own
    await until(lambda: bool(fleet.routable()))
    assert sample(router, in_flight, replica=engine.url) == 0
    engine.behavior.hang = False
    async with await request as response:
        assert response.status == 200
    assert sample(router, in_flight, replica=engine.url) == 0
    async with http.post(router.url + "/v1/completions", json=completion(stream=False)) as response:
        assert response.status == 200
    assert sample(router, in_flight, replica=engine.url) == 0
