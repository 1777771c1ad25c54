"""Reducing ``kvpilot bench serve`` JSON reports and HF floor output to the comparison's figures.

Everything here works on plain dicts (the reports as parsed JSON), so it is testable without a server. The
comparison's ``summary.json`` holds, per system, a status (``ok`` / ``failed`` / ``skipped``) with the
reason, the cold start, and one :func:`point_figures` dict per closed-loop level and per open-loop rate.
"""

from __future__ import annotations

from kvpilot.bench.metrics import P99_MIN_SAMPLES

STATUS_OK, STATUS_FAILED, STATUS_SKIPPED = "ok", "failed", "skipped"
#: each system's name in tables and plots, in the order they are shown
SYSTEM_TITLES = {
    "hf": "HF generate",
    "vllm": "vLLM (CPU)",
    "llamacpp": "llama.cpp server",
    "kvpilot": "kvpilot",
}
SERVERS = ("vllm", "llamacpp", "kvpilot")

# The figures from a machine of this kind (2 cores, fp32, 64 greedy tokens): output tokens/s by
# batch (HF) or concurrency (vLLM, with torch.compile). Shown beside ours; not measured here.
REFERENCE_OUTPUT_TPS = {
    "hf": {1: 14.0, 8: 60.0, 32: 177.0},
    "vllm": {1: 24.0, 8: 109.0, 32: 239.0},
}
GEMM_CEILING_OUTPUT_TPS = 450.0  # fp32 GEMM ceiling here (~120-135 GFLOP/s) in output tok/s at large batch


def _distribution(summary: dict, name: str) -> dict:
    dist = summary[name]
    return {"count": dist["count"], "p50": dist["p50"], "p99": dist["p99"], "mean": dist["mean"]}


def point_figures(point: dict) -> dict:
    """The figures of one ``bench serve`` report point (``report["points"][i]``) the comparison shows."""
    summary = point["summary"]
    load = point["load"]
    return {
        "mode": point["mode"],
        "load": float(load) if load != "inf" else float("inf"),
        "requests_total": summary["requests_total"],
        "requests_ok": summary["requests_ok"],
        "errors": summary["errors"],
        "window_s": summary["window_s"],
        "offered_rps": summary["arrival_rate_rps"],
        "request_rps": summary["request_throughput_rps"],
        "output_tps": summary["output_token_throughput_tps"],
        "total_tps": summary["total_token_throughput_tps"],
        "output_tokens": summary["output_tokens"],
        "output_token_source": summary["output_token_source"],
        "ttft_s": _distribution(summary, "ttft_s"),
        "tpot_s": _distribution(summary, "tpot_s"),
        "itl_s": _distribution(summary, "itl_s"),
        "e2e_s": _distribution(summary, "e2e_s"),
        "send_lag_p99_s": summary["send_lag_s"]["p99"],
        "warnings": list(summary["warnings"]),
    }


def cold_start_figures(report: dict, ready_after_s: float | None) -> dict:
    """Spawn-to-ready time (measured by the comparison) and the first warm-up request of the first run."""
    warmup = report["cold_start"]["warmup_records"]
    first = warmup[0] if warmup else None

    def seconds(record: dict | None, key: str) -> float | None:
        return None if record is None or not record.get("ok") else record.get(key)

    return {
        "ready_after_s": ready_after_s,
        "first_request_ttft_s": seconds(first, "ttft_s"),
        "first_request_e2e_s": seconds(first, "e2e_s"),
        "warmup_requests": len(warmup),
        "last_warmup_e2e_s": seconds(warmup[-1] if warmup else None, "e2e_s"),
    }


def saturation_figures(report: dict) -> dict | None:
    saturation = report.get("saturation")
    if saturation is None:
        return None
    return {
        "saturated": saturation["saturated"],
        "load": saturation.get("load"),
        "request_rps": saturation.get("request_throughput_rps"),
        "reason": saturation["reason"],
    }


def thin_p99(figures: dict) -> bool:
    """True when a point's p99 TTFT rests on too few samples to mean much (the table marks it)."""
    return figures["ttft_s"]["count"] < P99_MIN_SAMPLES


def output_tps_by_level(system: dict) -> dict[int, float]:
    """Output tok/s per closed-loop level (servers) or batch size (HF), for the table and plot."""
    if system.get("status") != STATUS_OK:
        return {}
    if "batches" in system:
        return {int(size): batch["output_tok_per_s"] for size, batch in system["batches"].items()}
    return {
        int(level): figures["output_tps"]
        for level, figures in system.get("closed", {}).items()
        if figures["requests_ok"] > 0
    }
