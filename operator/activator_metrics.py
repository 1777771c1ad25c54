"""The activator's own Prometheus metrics (``/metrics`` of ``kvpilot operator activator``), which the
operator's autoscaler reads as demand at zero (docs/architecture.md#scale-to-zero)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ActivatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvpilot_activator_requests", "Requests the activator received.", registry=self.registry
        )
        self.held = Gauge(
            "kvpilot_activator_held_requests", "Requests waiting for a Ready replica.", registry=self.registry
        )
        self.held_total = Counter(
            "kvpilot_activator_held", "Requests that had to wait for a replica.", registry=self.registry
        )
        self.rejected = Counter(
            "kvpilot_activator_rejected",
            "Held requests answered 503, by reason (queue_full, hold_timeout).",
            ["reason"],
            registry=self.registry,
        )
        self.cold_start_ttft = Histogram(
            "kvpilot_activator_cold_start_ttft_seconds",
            "Arrival to first response byte of requests held through a scale from zero.",
            buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
            registry=self.registry,
        )
        self.upstream_failures = Counter(
            "kvpilot_activator_upstream_failures",
            "Requests a replica took and failed to answer in full (answered 502, or ended with an error).",
            registry=self.registry,
        )
        for reason in ("queue_full", "hold_timeout"):
            self.rejected.labels(reason)
