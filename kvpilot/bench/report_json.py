"""The JSON report of ``bench serve``: configuration, metric definitions, every figure, every request.

Strict JSON: infinite values (``--request-rate inf``) are written as the string ``"inf"``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from kvpilot import __version__
from kvpilot.bench.config import ServeBenchConfig
from kvpilot.bench.metrics import P99_MIN_SAMPLES
from kvpilot.bench.runner import BenchmarkResult, PointResult

DEFINITIONS = {
    "clock": "client side, one monotonic clock; times in seconds from the start of each load point",
    "arrival": "open loop: the scheduled arrival time (not the send time: no coordinated omission); "
    "closed loop: when a client became free",
    "emit": "arrival at the client of an SSE event carrying output text",
    "ttft_s": "first emit - arrival",
    "itl_s": "gap between consecutive emits, pooled over successful requests",
    "tpot_s": "(last emit - first emit) / (output tokens - 1), requests with >= 2 output tokens",
    "e2e_s": "end of stream ([DONE]) - arrival; exceeds TTFT + sum(ITL) by the per-request tail_s",
    "send_lag_s": "actual send time - scheduled time: how far behind schedule the client was",
    "output_tokens": "server usage.completion_tokens when sent, else the number of emits",
    "prompt_tokens": "server usage.prompt_tokens when sent, else the prompt's word count (estimate)",
    "arrival_rate_rps": "(n - 1) / (last - first scheduled arrival): the rate actually offered",
    "window_s": "earliest arrival to latest end among the measured requests of the point",
    "request_throughput_rps": "successful requests / window",
    "output_token_throughput_tps": "output tokens of successful requests / window",
    "total_token_throughput_tps": "(prompt + output tokens) of successful requests / window",
    "slo_attainment": "requests meeting every given SLO / all measured requests (a ratio)",
    "goodput": "requests (and their output tokens) meeting every given SLO / window (a rate)",
    "percentiles": "linear interpolation between order statistics; latencies from successful requests; "
    f"a p99 on fewer than {P99_MIN_SAMPLES} samples is flagged",
    "warmup": "warm-up requests are sent one at a time before the first point and excluded from its stats",
    "saturation": "see kvpilot.bench.saturation: first point where latency exceeds factor x the "
    "lowest-load value, throughput gain falls below min gain, or (open loop) achieved < "
    "min efficiency x arrival_rate_rps; the saturation point is the one before it",
}


def _jsonable(value: object) -> object:
    """Dataclasses, paths and tuples to JSON types; non-finite floats to strings."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _json_object(value: object) -> dict:
    """``_jsonable`` of a dataclass (or mapping): a JSON object."""
    out = _jsonable(value)
    if not isinstance(out, dict):
        raise TypeError(f"expected a dataclass or a mapping, got {type(value).__name__}")
    return out


def _redacted(config: dict) -> dict:
    """The config without the API key's value (reports get shared)."""
    if config["endpoint"]["api_key"] is not None:
        config["endpoint"]["api_key"] = "<redacted>"
    return config


def _point_dict(point: PointResult) -> dict:
    return {
        "mode": point.mode,
        "load": _jsonable(point.load),
        "label": point.label,
        "summary": _jsonable(point.summary),
        "client_overhead": _jsonable(point.overhead),
        "records": [_jsonable(record.to_dict()) for record in point.records],
    }


def report_dict(config: ServeBenchConfig, result: BenchmarkResult, plots: list[Path]) -> dict:
    saturation = None
    if result.saturation is not None:
        saturation = _json_object(result.saturation)
        index = result.saturation.saturation_index
        if index is not None:
            point = result.points[index]
            saturation["load"] = _jsonable(point.load)
            saturation["request_throughput_rps"] = point.summary.request_throughput_rps
            saturation["latency_s"] = point.summary.latency(config.saturation.latency)
        saturation["rule"] = _jsonable(config.saturation)
    return {
        "tool": "kvpilot bench serve",
        "version": __version__,
        "started_at": result.started_at,
        "model": result.model,
        "config": _redacted(_json_object(config)),
        # the lengths actually sent when they were scaled to the served context (kvpilot.bench.context_fit)
        "context_fit": _jsonable(result.context_fit),
        "definitions": DEFINITIONS,
        "cold_start": {
            "ready": _jsonable(result.cold_start.ready),
            "warmup_records": [_jsonable(r.to_dict()) for r in result.cold_start.warmup_records],
        },
        "points": [_point_dict(point) for point in result.points],
        "saturation": saturation,
        "plots": [str(path) for path in plots],
    }


def write_report(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=1, allow_nan=False)
        handle.write("\n")
