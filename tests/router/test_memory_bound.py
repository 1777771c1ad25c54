"""Security (issue 26 item 2's attack, re-run): four clients at once each send a 30 MB body to ``kvpilot
router`` — declared (refused unread), chunked without a length (refused once 8 MiB have arrived) — and four
more send the largest body it accepts, an 8 MiB prompt (parsed, bounded by characters instead of
tokenized, refused by the engine). Before the fixes this took the router to 8.56 GB RSS and stalled small
requests for 55 s. Now its peak RSS grows by under 300 MB and small requests keep being answered while the
attack runs. The router and a real engine run as processes (``/proc`` gives the router's own peak RSS);
figures in bench/results/router_memory.md."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest
from live_server import ServerProcess, free_port, wait_ready

pytestmark = pytest.mark.slow
MB = 1_000_000
BIG = 30 * MB
LIMIT = 8 << 20  # the router's default body limit, the engine's
GROWTH_BOUND = 300 << 20


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--model", "tiny-random", "--num-kv-blocks", "128", "--warmup-buckets", "1x8"]
    server = ServerProcess(args, tmp_path_factory.mktemp("engine") / "engine.log")
    yield server.wait_ready(timeout_s=120)
    server.stop()


@pytest.fixture
def router(engine: ServerProcess, tmp_path: Path) -> Iterator[tuple[str, int]]:
    """``kvpilot router`` as a process in front of ``engine``: (its URL, its pid)."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvpilot.cli", "router", "--replicas", engine.url]
    cmd += ["--model", "tiny-random", "--host", "127.0.0.1", "--port", str(port)]
    with open(tmp_path / "router.log", "wb") as log:
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env=dict(os.environ)
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, 60, lambda: process.poll() is None)
        yield url, process.pid
    finally:
        process.terminate()
        process.wait(30)


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


async def _send(url: str, head: bytes, body: bytes, chunked: bool) -> int:
    """Send a request whose body may be refused part-way; the status the router answers with."""
    address = urlsplit(url)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    try:
        writer.write(head)
        step = 1 << 20
        try:
            for at in range(0, len(body), step):
                part = body[at : at + step]
                writer.write(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
                await writer.drain()
            if chunked:
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except ConnectionError:
            pass  # refused before all of it was sent: the answer is already there
        status_line = await asyncio.wait_for(reader.readline(), 60)
        return int(status_line.split()[1])
    finally:
        writer.close()


def _head(length: int | None) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{framing}\r\n\r\n"
    return head.encode()


async def _small_requests(url: str, stop: asyncio.Event) -> list[tuple[int, float]]:
    """Small completions one after another until ``stop``: (status, seconds) each."""
    answers = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        while not stop.is_set():
            start = time.monotonic()
            async with http.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}) as response:
                await response.read()
                answers.append((response.status, time.monotonic() - start))
    return answers


def test_security_four_30_mb_bodies_and_four_at_the_limit_keep_the_routers_memory_bounded(router):
    url, pid = router
    garbage = b"x" * BIG
    prompt = "a " * ((LIMIT - 64) // 2)
    largest = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    assert len(largest) <= LIMIT
    baseline = _status_kb(pid, "VmRSS")
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak from now on

    async def attack() -> tuple[list[int], list[tuple[int, float]]]:
        stop = asyncio.Event()
        small = asyncio.ensure_future(_small_requests(url, stop))
        big = [_send(url, _head(BIG), garbage, chunked=False) for _ in range(4)]
        big += [_send(url, _head(None), garbage, chunked=True) for _ in range(4)]
        big += [_send(url, _head(len(largest)), largest, chunked=False) for _ in range(4)]
        statuses = await asyncio.gather(*big)
        stop.set()
        return statuses, await small

    statuses, small = asyncio.run(attack())
    growth = _status_kb(pid, "VmHWM") - baseline
    print(
        f"router peak RSS growth {growth / 2**20:.1f} MiB over {baseline / 2**20:.1f} MiB; small requests: "
        f"{len(small)}, slowest {max(s for _, s in small):.2f} s"
    )
    assert statuses == [413] * 8 + [400] * 4  # the engine refuses the 8 MiB prompt by its characters
    assert growth < GROWTH_BOUND, growth
    assert small and all(status == 200 for status, _ in small)
    assert max(seconds for _, seconds in small) < 5.0
