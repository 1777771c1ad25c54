"""Security: a client that stops reading through the router holds a bounded number of bytes along the way —
the router's share (``--stream-buffer-bytes``: its client socket and write buffer, its upstream read
buffer and socket) plus the engine's — then the engine pauses the request, and the stream goes on when
the client reads again. A client that never reads again loses its connection after the router's
``--write-stall-timeout``, which closes the upstream request, so the engine cancels it and frees its
blocks, and the replica is not taken for a failed one. A real engine; the client on a raw socket, in a
thread, while the router runs on the test's loop."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from live_server import ServerProcess
from stalled_reader import LARGE_STREAM_REQUEST, StalledReader, produced_through

BUDGET = 64 << 10  # the engine's and the router's default stream budgets
REQUEST = LARGE_STREAM_REQUEST  # ~270 KB: without the bounds most of it would sit in buffers


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """No backpressure timeout: only the router's stall timeout can end a stalled stream."""
    args = ["--model", "tiny-random", "--num-kv-blocks", "128", "--warmup-buckets", "1x8"]
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    server = ServerProcess([*args, "--backpressure-timeout", "0"], log)
    yield server.wait_ready(timeout_s=120)
    server.stop()


async def _wait_load(http, url: str, done: Callable[[dict], bool], what: str, timeout_s: float = 10) -> None:
    """Poll the engine's ``/load`` until ``done(load)`` (AssertionError naming ``what`` at the deadline)."""
    deadline, load = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        async with http.get(url + "/load") as response:
            load = await response.json()
        if done(load):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what} (last /load: {load})")


def _paused(load: dict) -> bool:
    return load["backpressured"] == 1


def _all_free(load: dict) -> bool:
    return load["running"] == 0 and load["kv_blocks_free"] == load["kv_blocks_total"]


async def _settled_generated(http, url: str, timeout_s: float = 10) -> float:
    """The generation counter once two reads 50 ms apart agree: the engine's metrics follow its steps, and
    a paused request's last step may still be counting when the pause shows in ``/load``."""
    deadline, last = time.monotonic() + timeout_s, await _generated(http, url)
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        now = await _generated(http, url)
        if now == last:
            return now
        last = now
    raise AssertionError(f"the generation counter kept moving for {timeout_s} s (last {last})")


async def _generated(http, url: str) -> float:
    async with http.get(url + "/metrics") as response:
        lines = (await response.text()).splitlines()
    name = "kvpilot_generation_tokens_total"
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith((name + "{", name + " ")))


async def test_security_a_stalled_reader_through_the_router_holds_a_bounded_number_of_bytes(
    engine, routers, http
) -> None:
    router = await routers([engine.url])
    await _wait_load(http, engine.url, _all_free, "an idle engine")
    before = await _generated(http, engine.url)
    client = StalledReader(router.url, "/v1/completions", REQUEST)
    try:
        await asyncio.to_thread(client.read, 100_000)  # fast first: unset buffers would grow meanwhile
        await _wait_load(http, engine.url, _paused, "the engine to pause the request")
        generated = await _settled_generated(http, engine.url) - before
        consumed, queued = len(client.received), client.queued
        await asyncio.to_thread(client.read_to_end)  # reading again: the stream goes on to its end
    finally:
        client.close()
    events = client.events()
    assert events[-1].data == "[DONE]" and "error" not in events[-2].data
    largest = max(b.end - a.end for a, b in itertools.pairwise(events))
    held = produced_through(events, int(generated)) - consumed - queued  # the router's and the engine's
    assert 0 < held <= 2 * BUDGET + (4 * REQUEST["n"] + 2) * largest, (held, consumed, queued)
    assert generated < 2 * REQUEST["max_tokens"]  # it paused before the end


async def test_security_a_reader_that_never_reads_again_is_cut_by_the_router_and_its_request_freed(
    engine, routers, http
) -> None:
    router = await routers([engine.url], write_stall_timeout_s=1.0)
    await _wait_load(http, engine.url, _all_free, "an idle engine")
    before = await _generated(http, engine.url)
    client = StalledReader(router.url, "/v1/completions", REQUEST)
    try:
        await asyncio.to_thread(client.read, 100_000)
        await _wait_load(http, engine.url, _all_free, "the cut stream's request to be freed", timeout_s=20)
        await asyncio.to_thread(client.read_to_end)
    finally:
        client.close()
    assert client.reset and not client.received.endswith(b"0\r\n\r\n")  # cut, not ended
    assert await _generated(http, engine.url) - before < 2 * REQUEST["max_tokens"]  # cancelled, not done
    assert len(router.router.fleet.routable()) == 1  # the replica was not taken for a failed one
    async with http.post(router.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as ok:
        assert ok.status == 200
