"""The router over HTTP against fake engines: passthrough, its own endpoints, client errors, affinity."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess

import pytest

from kvpilot.engine.tenancy import TenantPolicy
from kvpilot.router.endpointslices import Endpoint
from kvpilot.router.json_body import parse_json
from kvpilot.router.proxy import REPLICA_HEADER

SYSTEM = "You are the support assistant of tenant alpha. " * 12  # about 30 blocks of the tiny tokenizer


def chat(user: str, stream: bool = True, system: str = SYSTEM) -> dict:
    return {
        "model": "fake-model",
        "stream": stream,
        "max_tokens": 8,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


def sse_texts(raw: bytes) -> list[str]:
    texts = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            texts += [c["text"] for c in json.loads(line[6:])["choices"]]
    return texts


async def test_streams_through_byte_for_byte_and_names_the_replica(fake_engines, routers, http):
    (engine,) = await fake_engines(1, output_tokens=4)
    router = await routers([engine.url])
    async with http.post(
        router.url + "/v1/chat/completions",
        json=chat("hi"),
        headers={"x-tenant": "alpha", "x-request-id": "r1"},
    ) as response:
        assert response.status == 200
        assert response.headers[REPLICA_HEADER] == engine.url
        assert response.headers["Content-Type"] == "text/event-stream"
        raw = await response.read()
    assert sse_texts(raw) == ["t0", "t1", "t2", "t3"]
    assert raw.endswith(b"data: [DONE]\n\n")
    path, headers, body = engine.received[0]
    assert (path, headers["x-tenant"], headers["x-request-id"], body) == (
        "/v1/chat/completions",
        "alpha",
        "r1",
        chat("hi"),
    )


async def test_requests_to_a_replica_reuse_one_keep_alive_connection(fake_engines, routers, http):
    (engine,) = await fake_engines(1)
    router = await routers([engine.url])
    for stream in (True, False, True):
        async with http.post(router.url + "/v1/chat/completions", json=chat("hi", stream=stream)) as response:
            assert response.status == 200
            await response.read()
    assert len(engine.inference_peers) == 3 and len(set(engine.inference_peers)) == 1


async def test_non_streaming_and_models_pass_through(fake_engines, routers, http):
    (engine,) = await fake_engines(1)
    router = await routers([engine.url])
    async with http.post(
        router.url + "/v1/completions?trace=1", json={"prompt": "hello world", "max_tokens": 3}
    ) as response:
        assert response.status == 200 and response.headers[REPLICA_HEADER] == engine.url
        assert (await response.json())["served_by"] == engine.port
    async with http.get(router.url + "/v1/models") as response:
        assert response.headers[REPLICA_HEADER] == engine.url
        assert (await response.json())["data"][0]["id"] == "fake-model"


async def test_router_endpoints_health_ready_and_json_errors(fake_engines, routers, http, until):
    (engine,) = await fake_engines(1, ready=False)
    router = await routers([engine.url], ready=0)
    async with http.get(router.url + "/health") as response:
        assert (response.status, await response.json()) == (200, {"status": "ok"})
    async with http.get(router.url + "/ready") as response:
        body = await response.json()
        assert response.status == 503 and body["ready"] is False
        assert body["replicas"] == [
            {"url": engine.url, "zone": None, "routable": False, "phase": "loading", "ejected": None}
        ]
    async with http.post(router.url + "/v1/completions", json={"prompt": "x"}) as response:
        assert response.status == 503
        assert (await response.json())["error"]["code"] == "no_ready_replica"
    engine.behavior.ready = True
    await until(lambda: router.router.fleet.routable())
    async with http.get(router.url + "/ready") as response:
        assert response.status == 200 and (await response.json())["routable"] == 1
    for payload, status, code in ((b"{not json", 400, "invalid_json"), (b"[1, 2]", 400, "invalid_json")):
        async with http.post(router.url + "/v1/completions", data=payload) as response:
            error = (await response.json())["error"]
            assert (response.status, error["code"], error["type"]) == (status, code, "invalid_request_error")
    async with http.post(
        router.url + "/v1/completions", json={"prompt": "x"}, headers={"x-tenant": "t" * 200}
    ) as response:
        assert (response.status, (await response.json())["error"]["code"]) == (400, "invalid_tenant")
    async with http.get(router.url + "/v2/nothing") as response:
        assert (response.status, (await response.json())["error"]["code"]) == (404, "not_found")
    async with http.get(router.url + "/v1/completions") as response:
        assert (response.status, (await response.json())["error"]["code"]) == (405, "method_not_allowed")
    assert engine.received == []  # none of the rejected requests reached the engine


async def test_an_oversized_body_is_refused_before_routing(fake_engines, routers, http):
    (engine,) = await fake_engines(1)
    router = await routers([engine.url], max_body_bytes=1000)
    async with http.post(router.url + "/v1/completions", json={"prompt": "x" * 2000}) as response:
        error = (await response.json())["error"]
        assert (response.status, error["code"], error["type"]) == (
            413,
            "request_too_large",
            "invalid_request_error",
        )
    assert engine.received == []


async def test_models_is_answered_by_a_ready_replica_and_is_not_a_routing_decision(
    fake_engines, routers, http
):
    broken, healthy = await fake_engines(2)
    router = await routers([broken.url, healthy.url], poll_interval_s=30.0)
    await broken.crash()
    for _ in range(2):
        async with http.get(router.url + "/v1/models") as response:
            assert (response.status, response.headers[REPLICA_HEADER]) == (200, healthy.url)
    registry = router.router.metrics.registry
    assert (
        registry.get_sample_value(
            "kvpilot_router_decisions_total", {"policy": "cache_aware", "reason": "cold"}
        )
        == 0
    )


async def test_a_shared_prefix_follows_its_cache_and_tenants_do_not_share(fake_engines, routers, http, until):
    engines = await fake_engines(3)
    router = await routers([e.url for e in engines])
    served = []
    for i in range(6):
        async with http.post(
            router.url + "/v1/chat/completions", json=chat(f"question {i}"), headers={"x-tenant": "alpha"}
        ) as response:
            served.append(response.headers[REPLICA_HEADER])
            await response.read()
    assert len(set(served)) == 1  # every alpha request went where alpha's system prompt is cached
    home = next(e for e in engines if e.url == served[0])
    decisions = "kvpilot_router_decisions_total"
    assert router_sample(router, decisions, policy="cache_aware", reason="cold") == 1
    assert router_sample(router, decisions, policy="cache_aware", reason="affinity") == 5
    # Another tenant's identical prompt shares no block (salted hashes): a cold decision again.
    async with http.post(
        router.url + "/v1/chat/completions", json=chat("question 0"), headers={"x-tenant": "beta"}
    ) as response:
        await response.read()
    assert router_sample(router, decisions, policy="cache_aware", reason="cold") == 2
    assert home.received[0][2] == chat("question 0")


async def test_metrics_are_exposed_and_promtool_clean(fake_engines, routers, http):
    (engine,) = await fake_engines(1)
    router = await routers([engine.url])
    async with http.post(router.url + "/v1/chat/completions", json=chat("hi")) as response:
        await response.read()
    async with http.get(router.url + "/metrics") as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = await response.text()
    for name in (
        "kvpilot_router_decisions_total",
        "kvpilot_router_estimated_ttft_seconds_bucket",
        "kvpilot_router_observed_ttft_seconds_bucket",
        "kvpilot_router_in_flight_requests",
        "kvpilot_router_routing_overhead_seconds_bucket",
        "kvpilot_router_retries_total",
        "kvpilot_router_routable_replicas",
        "kvpilot_router_kv_resyncs_total",
    ):
        assert name in text, name
    assert 'kvpilot_router_decisions_total{policy="cache_aware",reason="cold"} 1.0' in text
    assert "kvpilot_router_routing_overhead_seconds_count 1.0" in text
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail(
            "promtool is missing: run `bash scripts/setup.sh` (Debian's prometheus package)", pytrace=False
        )
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "caf\\u00e9 \\ud83d\\ude80", "max_tokens": 3, "temperature": 0.1}',
        b'{"a": NaN, "b": Infinity}',  # orjson refuses these; Python's json (and so the engine) accepts them
        b'{"a": 1, "a": 2}',
    ],
)
def test_request_bodies_parse_as_pythons_json_parses_them(raw: bytes) -> None:
    parsed, expected = parse_json(raw), json.loads(raw)
    assert json.dumps(parsed) == json.dumps(expected)  # NaN != NaN: compare the dumps


@pytest.mark.parametrize("raw", [b"{not json", b'{"a": 1', b"\xff\xfe", b"", b"[" * 100_000 + b"]" * 100_000])
def test_request_bodies_that_are_not_json_raise_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError):
        parse_json(raw)


def test_integers_beyond_64_bits_parse_as_numbers() -> None:
    # orjson reads them as floats; the router forwards the raw bytes, so the engine still reads them exactly
    assert parse_json(b'{"seed": 123456789012345678901234567890}') == {"seed": 1.2345678901234568e29}


async def test_a_replica_discovery_drops_keeps_no_connections_behind(fake_engines, routers, http):
    engines = await fake_engines(2)
    router = await routers([e.url for e in engines])
    app = router.router
    async with http.post(router.url + "/v1/chat/completions", json=chat("hello", stream=False)) as response:
        assert response.status == 200
        used = response.headers[REPLICA_HEADER]
    client = app.upstream
    assert client.replicas == {used}
    (other,) = [e.url for e in engines if e.url != used]
    app.fleet.set_endpoints([Endpoint(other)])
    assert client.replicas == set()
    async with http.post(router.url + "/v1/chat/completions", json=chat("again", stream=False)) as response:
        assert response.headers[REPLICA_HEADER] == other
    assert client.replicas == {other}


async def raw_status_line(url: str, head: bytes) -> tuple[bytes, float]:
    """Send ``head`` (request line, headers, maybe part of a body) and nothing more; the status line the
    server answers with, and how long it took."""
    import asyncio
    import time
    from urllib.parse import urlsplit

    address = urlsplit(url)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    writer.write(head)
    await writer.drain()
    start = time.monotonic()
    status_line = await asyncio.wait_for(reader.readline(), timeout=5)
    writer.close()
    return status_line, time.monotonic() - start


async def test_security_a_declared_oversized_body_is_refused_unread(fake_engines, routers):
    """A Content-Length beyond the limit is answered 413 at once, before any of the body is sent."""
    (engine,) = await fake_engines(1)
    router = await routers([engine.url], max_body_bytes=1000)
    status_line, _ = await raw_status_line(
        router.url,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: 30000000\r\n\r\n",
    )
    assert status_line.startswith(b"HTTP/1.1 413")
    assert engine.received == []


async def test_security_a_compressed_body_is_bounded_by_its_decoded_size(fake_engines, routers, http):
    """A few KiB of gzip that inflate past --max-body-bytes are a 413, not a body inflated whole."""
    (engine,) = await fake_engines(1)
    router = await routers([engine.url], max_body_bytes=4000)
    bomb = gzip.compress(b'{"prompt": "' + b"x" * (1 << 20) + b'"}', mtime=0)
    assert len(bomb) < 4000
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    async with http.post(router.url + "/v1/completions", data=bomb, headers=headers) as response:
        refused = response.status, (await response.json())["error"]
    assert refused[0] == 413
    assert (refused[1]["code"], refused[1]["message"]) == (
        "request_too_large",
        "the request body exceeds 4000 bytes once decoded from its Content-Encoding",
    )
    assert engine.received == []


def test_the_default_body_limit_is_the_engines():
    from kvpilot.engine.server.config import ServerConfig
    from kvpilot.router.config import UpstreamConfig

    assert UpstreamConfig().max_body_bytes == ServerConfig().max_body_bytes


TOKEN = "deployment-token-0123456789abcdef"


async def test_security_a_client_cannot_pass_a_router_token_through(fake_engines, routers, http):
    """A client's own x-kvpilot-router-token never reaches the engine: only the router may vouch."""
    (engine,) = await fake_engines(1)
    router = await routers([engine.url], router_token=TOKEN)
    async with http.post(
        router.url + "/v1/completions",
        json={"prompt": "x", "max_tokens": 1},
        headers={"x-tenant": "victim", "x-kvpilot-router-token": TOKEN},
    ) as response:
        assert response.status == 200
    (_, headers, _) = engine.received[-1]
    assert "x-kvpilot-router-token" not in headers and headers["x-tenant"] == "victim"


async def test_a_router_trusting_the_tenant_header_vouches_for_it(fake_engines, routers, http):
    (engine,) = await fake_engines(1)
    router = await routers([engine.url], router_token=TOKEN, trust_tenant_header=True)
    async with http.post(
        router.url + "/v1/completions",
        json={"prompt": "x", "max_tokens": 1},
        headers={"x-tenant": "gateway-set", "x-kvpilot-router-token": "forged"},
    ) as response:
        assert response.status == 200
    (_, headers, _) = engine.received[-1]
    assert headers.getall("x-kvpilot-router-token") == [TOKEN] and headers["x-tenant"] == "gateway-set"


def test_trusting_the_tenant_header_needs_the_token():
    from kvpilot.router.config import ConfigError, DiscoveryConfig, RouterConfig

    with pytest.raises(ConfigError, match="--trust-tenant-header needs --router-token"):
        RouterConfig(DiscoveryConfig(replicas=("http://127.0.0.1:1",)), trust_tenant_header=True)


async def test_security_a_trickled_body_is_timed_out_with_408(fake_engines, routers):
    """A client that declares a body and stops sending gets 408 after the body-read timeout (slowloris)."""
    (engine,) = await fake_engines(1)
    router = await routers([engine.url], body_read_timeout_s=0.3)
    status_line, seconds = await raw_status_line(
        router.url,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"prompt": ',
    )
    assert status_line.startswith(b"HTTP/1.1 408") and seconds < 3
    assert engine.received == []


async def test_a_body_timeout_is_an_invalid_request_error_and_its_connection_closes_at_once(
    fake_engines, routers
):
    """408 is the client's doing (OpenAI's and vLLM's type for it): not a server_error. The router reads no
    more of a body it gave up on: aiohttp would linger 10 s reading it before closing the connection."""
    import time

    from raw_http import error_of, exchange_async

    (engine,) = await fake_engines(1)
    router = await routers([engine.url], body_read_timeout_s=0.3)
    start = time.monotonic()
    status, headers, body = await exchange_async(
        router.url,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"prompt": ',
        timeout_s=5,
    )  # read until the router closes
    assert (status, error_of(body)["type"], error_of(body)["code"]) == (
        408,
        "invalid_request_error",
        "request_timeout",
    )
    assert headers["connection"] == "close" and time.monotonic() - start < 3


async def test_security_with_the_engines_keys_the_router_predicts_the_tenant_from_the_key(
    fake_engines, routers, http
):
    """Engines with API keys ignore a client's x-tenant: the tenant comes from its key. A router told the
    same keys predicts that tenant, so a key's requests keep their affinity whatever x-tenant they claim;
    without the keys it would salt by the claimed header and see every such request as cold."""
    keys = TenantPolicy(authenticated=True, key_tenants={"key-b": "beta"})
    engines = await fake_engines(2, tenancy=keys)
    bound = await routers([e.url for e in engines], api_keys_known=True, api_key_tenants=(("key-b", "beta"),))
    blind = await routers([e.url for e in engines])
    system = "You are a careful assistant. " * 12
    for router in (bound, blind):
        for claimed in ("alpha", "gamma", "delta"):
            async with http.post(
                router.url + "/v1/chat/completions",
                json=chat("hi", stream=False, system=system),
                headers={"Authorization": "Bearer key-b", "x-tenant": claimed},
            ) as response:
                assert response.status == 200
    decisions = "kvpilot_router_decisions_total"
    assert router_sample(bound, decisions, policy="cache_aware", reason="affinity") == 2
    assert router_sample(blind, decisions, policy="cache_aware", reason="affinity") == 0  # the control


def router_sample(router, name: str, **labels: str) -> float:
    value = router.router.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_security_a_trickled_request_head_is_timed_out_with_408(fake_engines, routers):
    """A head that starts and stops arriving gets 408 after the body-read timeout too (slowloris on the
    head: aiohttp alone would hold it for its keep-alive timeout, an hour)."""
    (engine,) = await fake_engines(1)
    router = await routers([engine.url], body_read_timeout_s=0.3)
    status_line, seconds = await raw_status_line(
        router.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl"
    )
    assert status_line.startswith(b"HTTP/1.1 408") and seconds < 3
    assert engine.received == []


async def test_a_prompt_the_engine_refused_is_not_taken_for_cached_there(fake_engines, routers, http):
    """A 400 is the engine's answer before any prefill: the prompt is not counted as cached on that replica
    (no affinity, no cached tokens for the next request with it), nor its answer time as a first token."""
    engines = await fake_engines(2, inference_status=400)
    router = await routers([e.url for e in engines], poll_interval_s=60)  # no events poll confirms anything
    async with http.post(router.url + "/v1/chat/completions", json=chat("refused", stream=False)) as response:
        assert response.status == 400
    for engine in engines:
        engine.behavior.inference_status = 200
    async with http.post(router.url + "/v1/chat/completions", json=chat("refused", stream=False)) as response:
        assert response.status == 200
    decisions = "kvpilot_router_decisions_total"
    assert router_sample(router, decisions, policy="cache_aware", reason="affinity") == 0
    assert router_sample(router, decisions, policy="cache_aware", reason="cold") == 2
    assert router_sample(router, "kvpilot_router_cached_prompt_tokens_total") == 0
    assert router_sample(router, "kvpilot_router_observed_ttft_seconds_count") == 1  # the 200 only
