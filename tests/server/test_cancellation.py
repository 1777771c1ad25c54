"""Client disconnects cancel promptly: 20 streaming requests dropped after a few chunks leave no running
request and every KV block free or cached within 1 s; a dropped non-streaming request is cancelled too."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.e2e
MODEL = "tiny-random"


def _finished(server, reason: str) -> float:
    prefix = f'kvpilot_requests_finished_total{{finished_reason="{reason}",model_name="{MODEL}"}} '
    line = next((li for li in server.get("/metrics").text.splitlines() if li.startswith(prefix)), None)
    return float(line.rsplit(" ", 1)[1]) if line else 0.0


def _idle(load: dict) -> bool:
    return load["running"] == 0 and load["waiting"] == 0 and load["kv_blocks_free"] == load["kv_blocks_total"]


def _wait_idle(server, within_s: float) -> dict:
    deadline = time.monotonic() + within_s
    while not _idle(load := server.get("/load").json()):
        assert time.monotonic() < deadline, f"not idle within {within_s} s: {load}"
    return load


def test_twenty_dropped_streams_free_everything_within_a_second(tiny_server):
    _wait_idle(tiny_server, 10)
    aborted_before = _finished(tiny_server, "abort")
    client = tiny_server.client()
    all_started = threading.Barrier(20)

    def drop_after_three_chunks(i: int) -> int:
        stream = client.completions.create(
            model=MODEL, prompt=f"cancel me {i}", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = [next(iter(stream)) for _ in range(3)]
        all_started.wait(30)  # all 20 are running when the first one leaves
        stream.close()
        return len(chunks)

    with ThreadPoolExecutor(20) as pool:
        assert list(pool.map(drop_after_three_chunks, range(20))) == [3] * 20
    dropped_at = time.monotonic()
    load = _wait_idle(tiny_server, 1.0)
    assert time.monotonic() - dropped_at < 1.0
    assert (load["kv_blocks_reserved"], load["backpressured"]) == (0, 0)
    assert _finished(tiny_server, "abort") == aborted_before + 20


def test_a_dropped_non_streaming_request_is_cancelled(tiny_server):
    _wait_idle(tiny_server, 10)
    aborted_before = _finished(tiny_server, "abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            tiny_server.url + "/v1/completions",
            headers=tiny_server.headers,
            # 480 tokens take tiny-random well over 0.1 s (about 0.3 s on a quiet 2-core host)
            timeout=0.1,
            json={"prompt": "never read", "max_tokens": 480, "ignore_eos": True},
        )
    _wait_idle(tiny_server, 1.0)
    assert _finished(tiny_server, "abort") == aborted_before + 1
