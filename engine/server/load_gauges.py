"""The server's gauges, read at scrape time from the engine loop's latest ``/load`` snapshot (so they can
never disagree with ``/load``) and from the lifecycle's phase; names and definitions: docs/metrics.md."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvpilot.engine.server.metrics import ServerMetrics


class LoadGauges(Collector):
    """Gauges read from the engine loop's published ``/load`` snapshot at scrape time."""

    _PHASES = ("loading", "warming_up", "ready", "draining", "failed")

    def __init__(self, metrics: ServerMetrics, load: Callable[[], dict], phase: Callable[[], str]) -> None:
        self._metrics, self._load, self._phase = metrics, load, phase

    def collect(self) -> Iterator[GaugeMetricFamily]:
        m = self._metrics.model_name
        snap = self._load()

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric([m], value)
            return g

        yield gauge(
            "kvpilot_num_requests_running",
            "Requests holding KV blocks (incl. backpressured).",
            snap.get("running", 0),
        )
        yield gauge(
            "kvpilot_num_requests_waiting",
            "Requests queued without KV blocks (incl. pending admission).",
            snap.get("waiting", 0),
        )
        yield gauge(
            "kvpilot_num_requests_swapped",
            "Requests whose KV is swapped to host memory.",
            snap.get("swapped", 0),
        )
        yield gauge(
            "kvpilot_num_requests_backpressured",
            "Running requests paused for a slow client.",
            snap.get("backpressured", 0),
        )
        yield gauge(
            "kvpilot_kv_cache_usage_ratio",
            "1 - allocatable KV blocks / usable blocks.",
            snap.get("kv_usage", 0.0),
        )
        yield gauge(
            "kvpilot_queued_prefill_tokens",
            "Prompt tokens still to compute.",
            snap.get("queued_prefill_tokens", 0),
        )
        blocks = GaugeMetricFamily(
            "kvpilot_kv_cache_blocks",
            "KV blocks by state (free includes cached-free).",
            labels=["model_name", "state"],
        )
        for state in ("total", "free", "cached", "reserved"):
            blocks.add_metric([m, state], snap.get(f"kv_blocks_{state}", 0))
        yield blocks
        info = GaugeMetricFamily(
            "kvpilot_cache_config_info",
            "KV cache configuration (value 1).",
            labels=["model_name", "block_size", "num_gpu_blocks", "kv_cache_sizing", "cache_dtype"],
        )
        if snap.get("block_size"):
            info.add_metric(
                [
                    m,
                    str(snap["block_size"]),
                    str(snap.get("kv_blocks_total", 0)),
                    snap.get("kv_cache_sizing", ""),
                    snap.get("kv_cache_dtype", ""),
                ],
                1,
            )
        yield info
        model_info = GaugeMetricFamily(
            "kvpilot_model_config_info",
            "Model weights configuration (value 1): quantization kept and activation dtype.",
            labels=["model_name", "quantization", "dtype"],
        )
        if snap.get("quantization"):
            model_info.add_metric([m, snap["quantization"], snap.get("dtype", "")], 1)
        yield model_info
        phase = GaugeMetricFamily(
            "kvpilot_server_phase", "1 for the server's current phase.", labels=["model_name", "phase"]
        )
        current = self._phase()
        for p in self._PHASES:
            phase.add_metric([m, p], 1.0 if p == current else 0.0)
        yield phase
        objectives = GaugeMetricFamily(
            "kvpilot_slo_objective_seconds",
            "Configured latency objectives.",
            labels=["model_name", "objective"],
        )
        for objective, value in (("ttft", self._metrics.slo_ttft_s), ("tpot", self._metrics.slo_tpot_s)):
            if value is not None:
                objectives.add_metric([m, objective], value)
        yield objectives
