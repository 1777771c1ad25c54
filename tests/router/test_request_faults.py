"""Failures of one request, not of its replica: an absolute-form request target, a request past
``--request-timeout``, an answer head too large to parse, a request an engine read and dropped. None
ejects a healthy replica or runs the request twice on one, and no secret of the request reaches the log."""

from __future__ import annotations

import json
import logging

from raw_http import error_of, exchange_async

from kvpilot.router.proxy import REPLICA_HEADER

SLOW = {"queued_prefill_tokens": 1_000_000}  # /load override: this replica looks far slower (chosen second)


def sample(router, name: str, **labels: str) -> float:
    value = router.router.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def ejections(router) -> float:
    samples = [s for m in router.router.metrics.ejections.collect() for s in m.samples]
    return sum(s.value for s in samples if s.name.endswith("_total"))


def completion(stream: bool = False) -> dict:
    return {"prompt": "hello there", "max_tokens": 4, "stream": stream}


async def test_security_an_absolute_form_target_is_forwarded_by_its_path_and_ejects_nobody(
    fake_engines, routers
):
    """``POST http://x/v1/completions`` made the upstream URL ``replica.url + "http://x/..."``: every such
    request ejected a replica and its retry the next, a denial of service for everyone else."""
    engines = await fake_engines(2)
    router = await routers([e.url for e in engines])
    body = json.dumps(completion()).encode()
    head = (
        b"POST http://x/v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    )
    for _ in range(3):
        status, _, reply = await exchange_async(router.url, head + body)
        assert (status, json.loads(reply)["choices"]) == (200, [{"text": "t0 t1 t2"}])
    assert sorted(path for e in engines for path, _, _ in e.received) == ["/v1/completions"] * 3
    assert (ejections(router), len(router.router.fleet.routable())) == (0, 2)


async def test_a_request_past_the_request_timeout_is_a_504_that_ejects_and_reruns_nothing(
    fake_engines, routers, http
):
    hanging, healthy = await fake_engines(2)
    healthy.behavior.load = SLOW
    hanging.behavior.hang = True
    router = await routers([hanging.url, healthy.url], request_timeout_s=0.3)
    async with http.post(router.url + "/v1/completions", json=completion()) as response:
        error = error_of(await response.read())
        assert (response.status, response.headers[REPLICA_HEADER]) == (504, hanging.url)
    assert error == {
        "message": "an upstream replica failed before answering: it ran past the router's request timeout",
        "type": "timeout",
        "param": None,
        "code": "upstream_timeout",
    }
    assert (len(hanging.received), len(healthy.received)) == (1, 0)
    assert (ejections(router), sample(router, "kvpilot_router_retries_total")) == (0, 0)
    assert len(router.router.fleet.routable()) == 2


async def test_a_stream_past_the_request_timeout_ends_with_a_504_event_and_ejects_nobody(
    fake_engines, routers, http
):
    (engine,) = await fake_engines(1, output_tokens=100, token_delay_s=0.02)
    router = await routers([engine.url], request_timeout_s=0.4)
    async with http.post(router.url + "/v1/completions", json=completion(stream=True)) as response:
        assert response.status == 200
        events = [e[6:] for e in (await response.read()).decode().split("\n\n") if e.startswith("data: ")]
    assert (ejections(router), len(router.router.fleet.routable())) == (0, 1)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"] == {
        "message": "an upstream replica failed mid-response: it ran past the router's request timeout",
        "type": "timeout",
        "param": None,
        "code": "upstream_timeout",
    }


async def test_an_answer_head_too_large_to_parse_is_a_502_that_ejects_and_reruns_nothing(
    fake_engines, routers, http
):
    """Both replicas answer this request with a 60 kB header (aiohttp's limit is 8 kB): it used to eject
    one, run again on the other and eject that one too."""
    first, second = await fake_engines(2, header_bytes=60_000)
    second.behavior.load = SLOW
    router = await routers([first.url, second.url])
    async with http.post(router.url + "/v1/completions", json=completion()) as response:
        error = error_of(await response.read())
        assert (response.status, response.headers[REPLICA_HEADER]) == (502, first.url)
    assert (error["message"], error["code"]) == (
        "an upstream replica failed before answering: its answer was malformed",
        "upstream_failed",
    )
    assert (len(first.received), len(second.received)) == (1, 0)
    assert (ejections(router), len(router.router.fleet.routable())) == (0, 2)


async def test_a_request_an_engine_read_and_dropped_runs_once_there(fake_engines, routers, http):
    """A fresh connection dropped after the engine read the request is no stale keep-alive connection:
    the request is not re-sent there (it ran twice on each replica); the replica is ejected and the one
    retry goes elsewhere, as for a replica that died."""
    dropping, healthy = await fake_engines(2)
    healthy.behavior.load = SLOW
    dropping.behavior.drop_unanswered = True
    router = await routers([dropping.url, healthy.url], poll_interval_s=30.0)
    async with http.post(router.url + "/v1/completions", json=completion()) as response:
        assert (response.status, response.headers[REPLICA_HEADER]) == (200, healthy.url)
    assert (len(dropping.received), len(healthy.received)) == (1, 1)
    assert sample(router, "kvpilot_router_ejections_total", replica=dropping.url, reason="error") == 1


async def test_security_no_client_key_or_router_token_reaches_the_log(fake_engines, routers, http, caplog):
    """aiohttp's ``repr()`` of a ``ClientResponseError`` holds the request's headers; the log lines of
    failed requests hold the error's status, message and URL only."""
    caplog.set_level(logging.DEBUG)
    malformed, dropping = await fake_engines(2)
    malformed.behavior.header_bytes = 60_000
    dropping.behavior.drop_unanswered = True
    for engine in (malformed, dropping):
        router = await routers([engine.url], trust_tenant_header=True, router_token="router-token-6f2a")
        headers = {"Authorization": "Bearer sk-client-key-91c4"}
        async with http.post(router.url + "/v1/completions", json=completion(), headers=headers) as response:
            assert response.status == 502
    logged = caplog.text
    assert "sk-client-key-91c4" not in logged and "router-token-6f2a" not in logged
    assert "malformed answer: ClientResponseError: 400" in logged  # the failures were logged
    assert "ServerDisconnectedError" in logged
