"""The latency definitions (docs/architecture.md#latency-definitions) on explicit emit times: TTFT, ITL (0
within a chunk), TPOT per sample, E2E, the TTFT + ΣITL identity, and SLO attainment."""

from __future__ import annotations

import pytest

from kvpilot.engine.server.request_timeline import Latencies, RequestTimeline, slo_attained


def test_definitions_on_known_emit_times():
    t = RequestTimeline(arrival=10.0)
    itls = t.emit(0, 1, 10.5) + t.emit(0, 2, 10.75) + t.emit(0, 1, 11.0)
    assert itls == [0.25, 0.0, 0.25]  # the chunk of two tokens: one gap, then 0
    lat = t.latencies(end=11.5)
    assert (lat.ttft, lat.tpots, lat.e2e, lat.num_output_tokens) == (0.5, [0.5 / 3], 1.5, 4)
    assert lat.ttft + sum(itls) == t.last_emit - t.arrival == 1.0


def test_samples_have_their_own_itl_and_tpot_and_share_ttft():
    t = RequestTimeline(arrival=0.0)
    assert t.emit(1, 1, 1.0) == [] and t.emit(0, 1, 2.0) == []
    assert t.emit(0, 1, 2.5) == [0.5] and t.emit(1, 1, 4.0) == [3.0]
    lat = t.latencies(end=5.0)
    assert (lat.ttft, sorted(lat.tpots), lat.num_output_tokens) == (1.0, [0.5, 3.0], 4)


def test_no_emit_means_no_ttft_and_empty_chunks_emit_nothing():
    t = RequestTimeline(arrival=0.0)
    assert t.emit(0, 0, 1.0) == []
    lat = t.latencies(end=2.0)
    assert (lat.ttft, lat.tpots, lat.e2e, t.last_emit) == (None, [], 2.0, None)


@pytest.mark.parametrize(
    ("lat", "reason", "ttft", "tpot", "attained"),
    [
        (Latencies(0.2, [0.05], 1.0, 10), "stop", 0.5, 0.1, True),
        (Latencies(0.2, [0.05], 1.0, 10), "length", None, None, True),  # no objective: completed is enough
        (Latencies(0.6, [0.05], 1.0, 10), "stop", 0.5, 0.1, False),
        (Latencies(0.2, [0.05, 0.2], 1.0, 10), "stop", 0.5, 0.1, False),  # every sample must meet TPOT
        (Latencies(0.2, [], 1.0, 1), "stop", 0.5, 0.1, True),  # one token: no TPOT to miss
        (Latencies(None, [], 1.0, 0), "stop", 0.5, None, False),
        (Latencies(0.2, [0.05], 1.0, 10), "abort", None, None, False),
        (Latencies(0.2, [0.05], 1.0, 10), "timeout", 0.5, 0.1, False),
    ],
)
def test_slo_attainment(lat, reason, ttft, tpot, attained):
    assert slo_attained(lat, reason, ttft, tpot) is attained
