"""The router in front of real engines: three ``kvpilot serve`` processes on the tiny model and two
independent in-process routers.

- Requests that share a tenant's long system prompt land with affinity: after a tenant's first request,
  every later one (through either router) goes to the replica that served it, and that engine answers
  from its prefix cache — ``usage.prompt_tokens_details.cached_tokens`` covers at least every full block
  it shares with the tenant's first request (more when an earlier question shares a longer prefix).
- SIGKILL of one engine mid-run loses no request that had not started streaming: every request either
  completes or had already received bytes from the killed replica; both routers eject it.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from live_server import ServerProcess

from kvpilot.engine.prompt_render import chat_prompt_ids
from kvpilot.engine.tokenizer import Tokenizer
from kvpilot.router.proxy import REPLICA_HEADER

BLOCK_SIZE = 16
ENGINE_ARGS = [
    "--model",
    "tiny-random",
    "--served-model-name",
    "tiny",
    "--block-size",
    str(BLOCK_SIZE),
    "--num-kv-blocks",
    "1024",
    "--warmup-buckets",
    "1x8",
]
TENANTS = 3


@pytest.fixture
def engines(tiny_model_dir: Path, tmp_path: Path) -> Iterator[list[ServerProcess]]:
    """Three fresh engines per test (no test inherits another's prefix caches), started together so their
    model loads overlap."""
    started = [ServerProcess(ENGINE_ARGS, tmp_path / f"engine{i}.log") for i in range(3)]
    try:
        for engine in started:
            engine.wait_ready(timeout_s=120)
        yield started
    finally:
        for engine in started:
            engine.stop()


async def kv_seq(session: aiohttp.ClientSession, engine: ServerProcess) -> int:
    async with session.get(engine.url + "/kv/events", params={"since": "0"}) as response:
        return (await response.json())["seq"]


def system_prompt(tenant: int) -> str:
    # the tenant comes first, so no two tenants share even the template's first block
    return f"{tenant}: you are this tenant's assistant. Follow the tenant {tenant} style guide closely. " * 8


def chat(tenant: int, question: str, max_tokens: int = 4, stream: bool = False) -> dict:
    return {
        "model": "tiny",
        "max_tokens": max_tokens,
        "stream": stream,
        "temperature": 0,
        "messages": [
            {"role": "system", "content": system_prompt(tenant)},
            {"role": "user", "content": question},
        ],
    }


def expected_cached_tokens(tokenizer: Tokenizer, first: dict, later: dict) -> int:
    """Full blocks of the prompt ids two requests share (the engine computes at least the last token)."""
    a, b = chat_prompt_ids(tokenizer, first["messages"]), chat_prompt_ids(tokenizer, later["messages"])
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return min(common, len(b) - 1) // BLOCK_SIZE * BLOCK_SIZE


async def routers_caught_up(session: aiohttp.ClientSession, engines: list[ServerProcess], routers) -> None:
    """Wait until every router's prefix index has applied every engine's newest KV event."""
    seqs = {e.url: await kv_seq(session, e) for e in engines}
    deadline = time.monotonic() + 10
    while not all(
        r.router.fleet.replicas[url].index.seq >= seq for r in routers for url, seq in seqs.items()
    ):
        assert time.monotonic() < deadline, "routers did not apply the engines' KV events in time"
        await asyncio.sleep(0.01)


async def test_shared_prefixes_land_with_affinity_and_hit_the_engines_prefix_cache(
    engines, routers, tiny_tokenizer
):
    urls = [e.url for e in engines]
    first, second = await routers(urls), await routers(urls)
    home: dict[int, str] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for tenant in range(TENANTS):  # one cold request per tenant
            async with session.post(
                first.url + "/v1/chat/completions", json=chat(tenant, "Hello?")
            ) as response:
                assert response.status == 200, await response.text()
                home[tenant] = response.headers[REPLICA_HEADER]
                assert (await response.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        await routers_caught_up(session, engines, (first, second))
        for round_ in range(3):
            for tenant in range(TENANTS):
                router = (first, second)[(round_ + tenant) % 2]
                body = chat(tenant, f"Question {round_} from tenant {tenant}: what is new?")
                async with session.post(router.url + "/v1/chat/completions", json=body) as response:
                    assert response.status == 200, await response.text()
                    assert response.headers[REPLICA_HEADER] == home[tenant], (tenant, round_)
                    usage = (await response.json())["usage"]
                cached = expected_cached_tokens(tiny_tokenizer, chat(tenant, "Hello?"), body)
                assert cached >= 4 * BLOCK_SIZE  # the shared system prompt spans several full blocks
                assert usage["prompt_tokens_details"]["cached_tokens"] >= cached


async def test_killing_an_engine_mid_run_loses_no_request_that_had_not_started_streaming(engines, routers):
    urls = [e.url for e in engines]
    by_url = {e.url: e for e in engines}
    first, second = await routers(urls), await routers(urls)
    outcomes: dict[int, str] = {}
    served_by: dict[int, str] = {}
    started_streaming: set[int] = set()

    async def client(i: int, session: aiohttp.ClientSession) -> None:
        router = (first, second)[i % 2]
        await asyncio.sleep(0.03 * i)
        body = chat(i % 5, f"Request {i}: tell me a story.", max_tokens=24, stream=True)
        try:
            async with session.post(router.url + "/v1/chat/completions", json=body) as response:
                served_by[i] = response.headers.get(REPLICA_HEADER, "")
                raw = b""
                async for chunk in response.content.iter_any():
                    raw += chunk
                    started_streaming.add(i)
                outcomes[i] = "ok" if response.status == 200 and raw.endswith(b"data: [DONE]\n\n") else "bad"
        except aiohttp.ClientError:
            outcomes[i] = "broken"

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        clients = [asyncio.create_task(client(i, session)) for i in range(40)]
        deadline = time.monotonic() + 30
        while len(served_by) < 3:  # kill once requests are flowing, whatever the host's speed
            assert time.monotonic() < deadline, "no request was routed in time"
            await asyncio.sleep(0.005)
        # the victim: the replica with the most requests in flight right now (routing decides which)
        in_flight = Counter(url for i, url in served_by.items() if i not in outcomes)
        victim = by_url[(in_flight or Counter(served_by.values())).most_common(1)[0][0]]
        victim.signal(signal.SIGKILL)
        victim.process.wait()
        killed_at = time.monotonic()
        await asyncio.gather(*clients)
        assert time.monotonic() - killed_at < 50

    assert len(outcomes) == 40
    lost = {i for i, outcome in outcomes.items() if outcome != "ok"}
    assert all(i in started_streaming and served_by[i] == victim.url for i in lost), (
        f"lost requests that had not started streaming from the killed engine: "
        f"{ {i: (outcomes[i], served_by.get(i)) for i in lost} }"
    )
    for router in (first, second):
        assert victim.url not in [r.url for r in router.router.fleet.routable()]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            for tenant in range(3):  # afterwards every tenant is served, by the survivors
                body = chat(tenant, "And now?")
                async with session.post(router.url + "/v1/chat/completions", json=body) as response:
                    assert response.status == 200, await response.text()
                    assert response.headers[REPLICA_HEADER] in set(urls) - {victim.url}
