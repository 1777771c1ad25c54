"""Metric math on hand-built timestamp records, with exactly known answers.

Times are binary fractions (0.25, 0.5, ...) so every difference is exact in floating point.
"""

from __future__ import annotations

import pytest

from kvpilot.bench.config import SLOConfig
from kvpilot.bench.metrics import distribution, meets_slo, summarize
from kvpilot.bench.records import PHASE_MEASURED, RequestRecord


def _record(
    index: int,
    scheduled: float,
    sent: float,
    emits: list[float],
    end: float,
    *,
    usage: tuple[int, int] | None = None,
    prompt_words: int = 10,
    error: str | None = None,
) -> RequestRecord:
    record = RequestRecord(
        index=index,
        phase=PHASE_MEASURED,
        prompt_words=prompt_words,
        max_tokens=8,
        scheduled_s=scheduled,
        sent_s=sent,
        emit_s=list(emits),
        end_s=end,
        error_type=error,
    )
    if usage is not None:
        record.usage_prompt_tokens, record.usage_output_tokens = usage
    return record


@pytest.fixture
def records() -> list[RequestRecord]:
    return [
        # A: on time, four emits, server usage (prompt 10, output 4)
        _record(0, 1.0, 1.0, [1.25, 1.5, 2.0, 2.25], 2.5, usage=(10, 4)),
        # B: sent 0.5 s late, two emits, no usage -> tokens counted from chunks, prompt from words
        _record(1, 2.0, 2.5, [3.0, 3.5], 3.5, prompt_words=20),
        # C: HTTP 500
        _record(2, 3.0, 3.0, [], 3.25, error="http_500"),
        # D: a single output token: no TPOT
        _record(3, 4.0, 4.0, [4.5], 5.0, usage=(8, 1)),
    ]


def test_per_request_definitions(records):
    a, b, c, d = records
    assert a.ttft_s == 0.25
    assert a.itl_s == [0.25, 0.5, 0.25]
    assert a.tpot_s == 1.0 / 3.0  # (2.25 - 1.25) / (4 - 1)
    assert a.e2e_s == 1.5
    assert a.tail_s == 0.25
    # TTFT + ΣITL is exactly last emit − arrival; E2E adds the tail after the last emit.
    assert a.ttft_s + sum(a.itl_s) == a.emit_s[-1] - a.scheduled_s
    assert a.e2e_s == a.ttft_s + sum(a.itl_s) + a.tail_s
    # B's latency counts from its schedule, not from its late send.
    assert b.ttft_s == 1.0 and b.send_lag_s == 0.5
    assert (b.output_tokens, b.output_token_source) == (2, "chunks")
    assert (b.prompt_tokens, b.prompt_token_source) == (20, "word_estimate")
    assert b.tpot_s == 0.5
    assert (c.ttft_s, c.tpot_s, c.e2e_s, c.itl_s) == (None, None, None, [])
    assert d.tpot_s is None and d.ttft_s == 0.5 and d.itl_s == []


def test_summary_throughputs_and_distributions(records):
    summary = summarize(records, SLOConfig())
    assert (summary.requests_total, summary.requests_ok, summary.requests_failed) == (4, 3, 1)
    assert summary.window_s == 4.0  # first arrival 1.0 to last end 5.0
    assert summary.arrival_rate_rps == 1.0  # 3 gaps over arrivals 1.0 .. 4.0
    assert summary.output_tokens == 7 and summary.prompt_tokens == 38
    assert summary.request_throughput_rps == 0.75
    assert summary.output_token_throughput_tps == 1.75
    assert summary.total_token_throughput_tps == 11.25
    ttft = summary.ttft_s  # [0.25, 1.0, 0.5]
    assert ttft.count == 3
    assert ttft.mean == pytest.approx(1.75 / 3, abs=1e-15)
    assert ttft.p50 == 0.5
    assert ttft.p90 == pytest.approx(0.9, abs=1e-12)  # 0.5 + 0.8 × (1.0 − 0.5)
    assert ttft.p99 == pytest.approx(0.99, abs=1e-12)
    assert (summary.tpot_s.count, summary.tpot_s.p50) == (2, pytest.approx(5 / 12, abs=1e-15))
    assert (summary.itl_s.count, summary.itl_s.mean, summary.itl_s.p50) == (4, 0.375, 0.375)
    assert (summary.e2e_s.count, summary.e2e_s.p50) == (3, 1.5)
    assert summary.slo is None
    assert summary.errors == {"http_500": 1}
    assert summary.output_token_source == "mixed: counted chunks 1/3, server usage 2/3"
    assert summary.prompt_token_source == "mixed: server usage 2/3, word-count estimate 1/3"
    assert summary.latency("ttft_p50") == 0.5 and summary.latency("e2e_p50") == 1.5


def test_slo_attainment_is_a_ratio_and_goodput_a_rate(records):
    summary = summarize(records, SLOConfig(ttft_s=0.6, tpot_s=0.4))
    slo = summary.slo
    # A meets both; B misses TTFT (1.0); C failed; D meets TTFT and has no TPOT.
    assert [meets_slo(r, SLOConfig(ttft_s=0.6, tpot_s=0.4)) for r in records] == [True, False, False, True]
    assert (slo.met, slo.total) == (2, 4)
    assert slo.attainment == 0.5
    assert slo.goodput_rps == 0.5  # 2 requests / 4 s
    assert slo.goodput_output_tps == 1.25  # (4 + 1) tokens / 4 s
    only_tpot = summarize(records, SLOConfig(tpot_s=0.4)).slo
    assert (only_tpot.met, only_tpot.attainment) == (2, 0.5)  # B's TPOT 0.5 misses, C failed


def test_warnings_name_thin_p99s_and_late_sends(records):
    warnings = summarize(records, SLOConfig()).warnings
    assert warnings[0] == (
        "p99 rests on fewer than 100 samples for TTFT (3), TPOT (2), ITL (4), E2E (3): "
        "treat those p99s as noisy"
    )
    assert warnings[1].startswith("requests went out late: send lag p99 485.0 ms")
    assert len(warnings) == 2


def test_distribution_percentiles_on_known_data():
    dist = distribution([float(v) for v in range(1, 102)])  # 1 .. 101
    assert (dist.count, dist.mean, dist.p50, dist.p90, dist.p99) == (101, 51.0, 51.0, 91.0, 100.0)
    empty = distribution([])
    assert (empty.count, empty.mean, empty.p99) == (0, None, None)


def test_enough_samples_and_punctual_client_give_no_warnings():
    records = [
        _record(i, i * 0.5, i * 0.5, [i * 0.5 + 0.25, i * 0.5 + 0.5], i * 0.5 + 0.5, usage=(5, 2))
        for i in range(100)
    ]
    summary = summarize(records, SLOConfig())
    assert summary.warnings == ()
    assert summary.tpot_s.count == 100 and summary.tpot_s.p99 == 0.25
    assert summary.output_token_source == "server usage (100/100)"


def test_summarize_needs_records():
    with pytest.raises(ValueError, match="no requests"):
        summarize([], SLOConfig())
