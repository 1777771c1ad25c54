"""The human-readable report of ``bench serve``: one block per load point, cold start, sweep summary."""

from __future__ import annotations

from collections.abc import Sequence

from kvpilot.bench.config import ServeBenchConfig
from kvpilot.bench.metrics import Distribution, PointSummary
from kvpilot.bench.runner import BenchmarkResult, ColdStart, PointResult
from kvpilot.bench.saturation import SaturationResult


def _ms(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value * 1e3:.{digits}f}"


def _latency_row(name: str, dist: Distribution) -> str:
    cells = [_ms(dist.mean), _ms(dist.p50), _ms(dist.p90), _ms(dist.p99)]
    return f"  {name:<6}{dist.count:>9}" + "".join(f"{cell:>10}" for cell in cells)


def format_point(point: PointResult) -> str:
    s: PointSummary = point.summary
    lines = [
        f"== {point.label} ==",
        f"requests    {s.requests_total} measured: {s.requests_ok} ok, {s.requests_failed} failed"
        f" | window {s.window_s:.2f} s (first arrival to last completion)"
        + (f" | arrivals offered {s.arrival_rate_rps:.3f} req/s" if point.mode == "open" else ""),
        _failed_mark(s) + f"throughput  request {s.request_throughput_rps:.3f} req/s | output-token "
        f"{s.output_token_throughput_tps:.1f} tok/s | total-token (prompt+output) "
        f"{s.total_token_throughput_tps:.1f} tok/s",
        f"latency ms  {'n':>7}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
        _latency_row("TTFT", s.ttft_s),
        _latency_row("TPOT", s.tpot_s),
        _latency_row("ITL", s.itl_s),
        _latency_row("E2E", s.e2e_s),
    ]
    if s.slo is not None:
        parts = []
        if s.slo.ttft_s is not None:
            parts.append(f"TTFT<={_ms(s.slo.ttft_s, 0)} ms")
        if s.slo.tpot_s is not None:
            parts.append(f"TPOT<={_ms(s.slo.tpot_s, 0)} ms")
        lines.append(
            f"SLO         {', '.join(parts)}: attainment {s.slo.attainment:.1%} ({s.slo.met}/{s.slo.total})"
            f" | goodput {s.slo.goodput_rps:.3f} req/s, {s.slo.goodput_output_tps:.1f} output tok/s"
        )
    errors = ", ".join(f"{kind}: {count}" for kind, count in s.errors.items()) or "none"
    lines.append(f"errors      {errors}")
    lines += [
        f"            first {kind}: {detail or '(no detail)'}" for kind, detail in s.error_examples.items()
    ]
    lines.append(f"tokens      output: {s.output_token_source} | prompt: {s.prompt_token_source}")
    o = point.overhead
    lines.append(
        f"client      send lag p50 {_ms(s.send_lag_s.p50, 2)} / p99 {_ms(s.send_lag_s.p99, 2)} ms"
        f" | event-loop lag p99 {_ms(o.loop_lag_p99_s, 2)} / max {_ms(o.loop_lag_max_s, 2)} ms"
        f" ({o.loop_lag_samples} samples) | CPU {o.cpu_utilization:.0%} of a core"
    )
    lines += [f"warning     {note}" for note in s.warnings]
    return "\n".join(lines)


def _failed_mark(s: PointSummary) -> str:
    """A line above the throughput of a point with failed requests: its figures count only the rest."""
    if not s.requests_failed:
        return ""
    return (
        f"FAILED      {s.requests_failed} of {s.requests_total} requests failed (see errors below); the "
        "figures cover only the successful ones\n"
    )


def refusals(result: BenchmarkResult) -> str | None:
    """Why the run measured nothing worth reporting, or None: requests the endpoint refused as invalid
    (HTTP 4xx other than 408 and 429, which say "later", not "wrong") mean the benchmark's requests do not
    suit it, and a point where no request succeeded has no latency or throughput at all."""
    records = [*result.cold_start.warmup_records, *(r for point in result.points for r in point.records)]
    refused = [r for r in records if r.error_type in _REFUSALS]
    if refused:
        return (
            f"{len(refused)} of {len(records)} requests were refused as invalid, the first with "
            f"{refused[0].error_type}: {refused[0].error_detail}"
        )
    empty = [point.label for point in result.points if point.summary.requests_ok == 0]
    return f"no request succeeded at {'; '.join(empty)}" if empty else None


_REFUSALS = frozenset(f"http_{status}" for status in range(400, 500) if status not in (408, 429))


def format_cold_start(cold: ColdStart, steady: PointSummary | None) -> str:
    lines = ["== cold start (excluded from the statistics above) =="]
    if cold.ready is not None:
        lines.append(
            f"ready       {cold.ready.url} answered 200 after {cold.ready.time_to_ready_s:.2f} s "
            f"({cold.ready.polls} polls)"
        )
    if not cold.warmup_records:
        lines.append("warm-up     none (--warmup-requests 0)")
        return "\n".join(lines)
    cells = []
    for record in cold.warmup_records:
        if record.ok:
            cells.append(f"TTFT {_ms(record.ttft_s)} ms, E2E {_ms(record.e2e_s)} ms")
        else:
            cells.append(f"failed ({record.error_type}: {record.error_detail or 'no detail'})")
    lines.append(f"warm-up     {len(cells)} sequential requests: " + "; ".join(cells))
    first = cold.warmup_records[0].ttft_s
    if first is not None and steady is not None and steady.ttft_s.p50:
        lines.append(
            f"            first-request TTFT is {first / steady.ttft_s.p50:.1f}× the first "
            "load point's p50 TTFT"
        )
    return "\n".join(lines)


def format_sweep(
    points: Sequence[PointResult], saturation: SaturationResult, config: ServeBenchConfig
) -> str:
    head = (
        f"{'load':>10}{'req/s':>9}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'TPOT p50':>10}{'TPOT p99':>10}{'attain':>8}{'goodput':>9}"
    )
    lines = [f"== sweep ({config.load.mode} loop; latencies in ms, goodput in req/s) ==", head]
    for index, point in enumerate(points):
        s = point.summary
        attain = "-" if s.slo is None else f"{s.slo.attainment:.0%}"
        goodput = "-" if s.slo is None else f"{s.slo.goodput_rps:.2f}"
        mark = " <- saturation" if index == saturation.saturation_index and saturation.saturated else ""
        mark = " <- knee" if index == saturation.knee_index else mark
        mark += f" ({s.requests_failed} of {s.requests_total} FAILED)" if s.requests_failed else ""
        lines.append(
            f"{point.load:>10g}{s.request_throughput_rps:>9.2f}{s.output_token_throughput_tps:>11.1f}"
            f"{_ms(s.ttft_s.p50):>10}{_ms(s.ttft_s.p99):>10}{_ms(s.tpot_s.p50):>10}{_ms(s.tpot_s.p99):>10}"
            f"{attain:>8}{goodput:>9}{mark}"
        )
    lines.append(f"saturation  {describe_saturation(points, saturation, config)}")
    return "\n".join(lines)


def describe_saturation(
    points: Sequence[PointResult], saturation: SaturationResult, config: ServeBenchConfig
) -> str:
    watched = config.saturation.latency
    if not saturation.saturated:
        last = points[-1].summary
        return (
            f"not reached within the sweep; the highest load sustained {last.request_throughput_rps:.3f} "
            f"req/s at {watched} {_ms(last.latency(watched))} ms (a lower bound on capacity)"
        )
    if saturation.saturation_index is None:
        return f"already at the lowest load: {saturation.reason}"
    point = points[saturation.saturation_index]
    return (
        f"load {point.load:g}: {point.summary.request_throughput_rps:.3f} req/s at {watched} "
        f"{_ms(point.summary.latency(watched))} ms; knee after it because {saturation.reason}"
    )
