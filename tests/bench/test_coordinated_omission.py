"""No coordinated omission: latency counts from the scheduled arrival, so a stall shows in later requests.

The fake server stalls its first request for STALL_S. The assertions are lower bounds that follow from
the setup alone (a sleep never ends early), not from timing luck.
"""

from __future__ import annotations

from itertools import pairwise

import aiohttp
import pytest

from kvpilot.bench.config import EndpointConfig, SLOConfig
from kvpilot.bench.load_generation import run_closed_loop, run_open_loop
from kvpilot.bench.metrics import summarize
from kvpilot.bench.sse_client import OpenAIStreamClient
from kvpilot.bench.workloads import RequestSpec

STALL_S = 0.6
OFFSETS = [0.0, 0.1, 0.2, 0.3]


def _specs(count: int) -> list[RequestSpec]:
    return [RequestSpec(index=i, prompt="a b c", max_tokens=2, prompt_words=3) for i in range(count)]


async def _open_loop(url: str, max_concurrency: int | None):
    async with aiohttp.ClientSession() as session:
        client = OpenAIStreamClient(session, EndpointConfig(base_url=url), "fake-model")
        schedule = list(zip(OFFSETS, _specs(len(OFFSETS)), strict=True))
        return await run_open_loop(client, schedule, max_concurrency=max_concurrency)


async def test_client_that_falls_behind_still_counts_latency_from_the_schedule(fake_server):
    # A client-side cap of one request in flight: requests due during the stall cannot go out.
    server = fake_server(token_delay_s=0.001, stall_first_request_s=STALL_S)
    records = await _open_loop(server.url, max_concurrency=1)
    assert all(r.ok for r in records)
    assert records[0].ttft_s >= STALL_S
    for previous, record in pairwise(records):
        # Each waited for the previous to finish, so it went out late ...
        assert record.sent_s >= previous.end_s
        assert record.send_lag_s >= STALL_S - record.scheduled_s
        # ... and its TTFT includes that wait: TTFT from the schedule = TTFT from the send + send lag.
        assert record.ttft_s >= STALL_S - record.scheduled_s
        assert record.ttft_s == pytest.approx(
            (record.emit_s[0] - record.sent_s) + record.send_lag_s, abs=1e-12
        )
    summary = summarize(records, SLOConfig(ttft_s=0.2))
    assert summary.ttft_s.p50 >= STALL_S - 0.2  # median of >= [0.6, 0.5, 0.4, 0.3]
    assert summary.slo.met == 0  # every request saw the stall
    assert any(w.startswith("requests went out late") for w in summary.warnings)


async def test_open_loop_keeps_sending_on_schedule_while_the_server_stalls(fake_server):
    # No client cap, a server with one slot: requests queue at the server, not at the client.
    server = fake_server(token_delay_s=0.001, stall_first_request_s=STALL_S, serialize=True)
    records = await _open_loop(server.url, max_concurrency=None)
    assert all(r.ok for r in records)
    # Sent while request 0 was still stalled: the schedule did not wait for it.
    assert all(r.sent_s < STALL_S for r in records)
    for record in records[1:]:
        assert record.ttft_s >= STALL_S - record.scheduled_s  # queued behind the stall at the server


async def test_closed_loop_measures_from_when_a_client_became_free(fake_server):
    server = fake_server(token_delay_s=0.001, stall_first_request_s=STALL_S)
    async with aiohttp.ClientSession() as session:
        client = OpenAIStreamClient(session, EndpointConfig(base_url=server.url), "fake-model")
        records = await run_closed_loop(
            client, iter(_specs(3)), concurrency=1, num_requests=3, duration_s=None
        )
    assert [r.index for r in records] == [0, 1, 2]
    assert records[0].ttft_s >= STALL_S
    # Closed loop: the next arrival is when the client became free, so the stall is not in later TTFTs
    # (that is exactly the blind spot the open loop avoids).
    assert records[1].scheduled_s >= records[0].end_s
    assert records[1].send_lag_s == pytest.approx(0.0, abs=0.05)
