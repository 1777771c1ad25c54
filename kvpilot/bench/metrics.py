"""Aggregate statistics of one load point: latency distributions, throughput, SLO attainment, goodput.

Conventions (reported alongside the numbers):
- Percentiles interpolate linearly between order statistics (numpy's default ``linear`` method).
- Latency distributions use successful requests only; ITL pools the gaps of all of them.
- The arrival rate is the rate the schedule actually offered: (n − 1) / (last − first arrival), the
  estimate of a Poisson rate from n arrivals (inf when all arrive at once); it differs from the nominal
  --request-rate by sampling noise, and in closed loop it merely follows the server.
- The measurement window runs from the earliest arrival to the latest end among the point's measured
  requests (failed ones included), so it includes draining the last requests.
- Three throughputs, all over that window and all counting successful requests only:
  request throughput (req/s), output-token throughput (output tok/s), total-token throughput
  ((prompt + output) tok/s).
- SLO attainment = requests meeting every given SLO / all measured requests (a ratio; failed requests
  count as misses). Goodput = the requests (and their output tokens) meeting every given SLO per second of
  the window (a rate). A request with a single output token has no TPOT and meets any TPOT SLO.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from kvpilot.bench.config import SLOConfig
from kvpilot.bench.records import RequestRecord

P99_MIN_SAMPLES = 100  # below this a p99 is mostly noise; the report says so
SEND_LAG_WARN_S = 0.010  # p99 lateness of the client beyond which the report warns


@dataclass(frozen=True)
class Distribution:
    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    def percentile(self, name: str) -> float | None:
        return {"mean": self.mean, "p50": self.p50, "p90": self.p90, "p99": self.p99}[name]


def distribution(values: Sequence[float]) -> Distribution:
    if len(values) == 0:
        return Distribution(count=0, mean=None, p50=None, p90=None, p99=None)
    data = np.asarray(values, dtype=float)
    p50, p90, p99 = (float(v) for v in np.percentile(data, [50, 90, 99]))
    return Distribution(count=len(data), mean=float(data.mean()), p50=p50, p90=p90, p99=p99)


@dataclass(frozen=True)
class SLOResult:
    ttft_s: float | None  # the TTFT SLO applied (None: not part of the SLO)
    tpot_s: float | None  # the TPOT SLO applied
    met: int  # requests meeting every given SLO
    total: int  # all measured requests
    attainment: float  # met / total
    goodput_rps: float  # met / window, requests/s
    goodput_output_tps: float  # output tokens of the requests that met it / window, tokens/s


@dataclass(frozen=True)
class PointSummary:
    requests_total: int
    requests_ok: int
    requests_failed: int
    window_s: float
    arrival_rate_rps: float  # rate of the scheduled arrivals actually offered (see module docstring)
    prompt_tokens: int  # of successful requests
    output_tokens: int  # of successful requests
    request_throughput_rps: float
    output_token_throughput_tps: float
    total_token_throughput_tps: float
    ttft_s: Distribution
    tpot_s: Distribution
    itl_s: Distribution
    e2e_s: Distribution
    send_lag_s: Distribution  # how late the client sent requests versus their schedule (all requests)
    slo: SLOResult | None  # None when no SLO was given
    errors: dict[str, int]  # error type -> count
    error_examples: dict[str, str]  # error type -> the detail (e.g. the response body) of its first request
    output_token_source: str  # where output token counts came from (server usage or counted chunks)
    prompt_token_source: str  # where prompt token counts came from (server usage or word estimate)
    warnings: tuple[str, ...]

    def latency(self, name: str) -> float | None:
        """A figure such as ``"ttft_p50"`` or ``"e2e_p99"``."""
        metric, stat = name.split("_")
        return getattr(self, f"{metric}_s").percentile(stat)

    def to_dict(self) -> dict:
        return asdict(self)


def meets_slo(record: RequestRecord, slo: SLOConfig) -> bool:
    if not record.ok:
        return False
    ttft, tpot = record.ttft_s, record.tpot_s
    if slo.ttft_s is not None and (ttft is None or ttft > slo.ttft_s):
        return False
    return not (slo.tpot_s is not None and tpot is not None and tpot > slo.tpot_s)


def summarize(records: Sequence[RequestRecord], slo: SLOConfig) -> PointSummary:
    """Statistics of one load point's measured requests (at least one)."""
    if not records:
        raise ValueError("no requests to summarize")
    ok = [r for r in records if r.ok]
    window = max(r.end_s if r.end_s is not None else r.sent_s for r in records) - min(
        r.scheduled_s for r in records
    )
    # Guard the rates against a zero window (a single instant failure).
    per_second = 1.0 / window if window > 0 else 0.0
    arrivals = sorted(r.scheduled_s for r in records)
    span = arrivals[-1] - arrivals[0]
    arrival_rate = (len(arrivals) - 1) / span if span > 0 else math.inf
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)

    slo_result = None
    if slo.given:
        met = [r for r in records if meets_slo(r, slo)]
        slo_result = SLOResult(
            ttft_s=slo.ttft_s,
            tpot_s=slo.tpot_s,
            met=len(met),
            total=len(records),
            attainment=len(met) / len(records),
            goodput_rps=len(met) * per_second,
            goodput_output_tps=sum(r.output_tokens for r in met) * per_second,
        )

    ttft = distribution([r.ttft_s for r in ok if r.ttft_s is not None])
    tpot = distribution([r.tpot_s for r in ok if r.tpot_s is not None])
    itl = distribution([gap for r in ok for gap in r.itl_s])
    e2e = distribution([r.e2e_s for r in ok if r.e2e_s is not None])
    send_lag = distribution([r.send_lag_s for r in records])
    return PointSummary(
        requests_total=len(records),
        requests_ok=len(ok),
        requests_failed=len(records) - len(ok),
        window_s=window,
        arrival_rate_rps=arrival_rate,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        request_throughput_rps=len(ok) * per_second,
        output_token_throughput_tps=output_tokens * per_second,
        total_token_throughput_tps=(prompt_tokens + output_tokens) * per_second,
        ttft_s=ttft,
        tpot_s=tpot,
        itl_s=itl,
        e2e_s=e2e,
        send_lag_s=send_lag,
        slo=slo_result,
        errors=dict(sorted(Counter(r.error_type or "unknown" for r in records if not r.ok).items())),
        error_examples=_first_details([r for r in records if not r.ok]),
        output_token_source=_source_label(
            [r.output_token_source for r in ok], {"usage": "server usage", "chunks": "counted chunks"}
        ),
        prompt_token_source=_source_label(
            [r.prompt_token_source for r in ok],
            {"usage": "server usage", "word_estimate": "word-count estimate"},
        ),
        warnings=tuple(_warnings({"TTFT": ttft, "TPOT": tpot, "ITL": itl, "E2E": e2e}, send_lag)),
    )


def _first_details(failed: Sequence[RequestRecord]) -> dict[str, str]:
    examples: dict[str, str] = {}
    for record in failed:
        examples.setdefault(record.error_type or "unknown", record.error_detail or "")
    return dict(sorted(examples.items()))


def _source_label(sources: list[str], names: dict[str, str]) -> str:
    if not sources:
        return "none (no successful requests)"
    counts = Counter(sources)
    if len(counts) == 1:
        return f"{names[sources[0]]} ({len(sources)}/{len(sources)})"
    return "mixed: " + ", ".join(f"{names[k]} {n}/{len(sources)}" for k, n in sorted(counts.items()))


def _warnings(latencies: dict[str, Distribution], send_lag: Distribution) -> list[str]:
    notes = []
    thin = [f"{name} ({dist.count})" for name, dist in latencies.items() if 0 < dist.count < P99_MIN_SAMPLES]
    if thin:
        notes.append(
            f"p99 rests on fewer than {P99_MIN_SAMPLES} samples for {', '.join(thin)}: "
            "treat those p99s as noisy"
        )
    if send_lag.p99 is not None and send_lag.p99 > SEND_LAG_WARN_S:
        notes.append(
            f"requests went out late: send lag p99 {send_lag.p99 * 1e3:.1f} ms (client fell behind or a "
            "concurrency cap queued them); latencies still count from the scheduled time"
        )
    return notes
