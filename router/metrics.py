"""The router's Prometheus metrics (``kvpilot_router_*``), on a registry of its own so several routers can
live in one process (tests) without clashing. Names follow Prometheus conventions (base units in the name,
counters end in ``_total``) and pass ``promtool check metrics``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kvpilot.router.scoring import REASONS

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Routing overhead is about a millisecond when healthy; the 5 ms p99 target sits on a bucket edge.
OVERHEAD_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.00075,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    def __init__(self, policy: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.policy = policy
        r = self.registry
        self.decisions = Counter(
            "kvpilot_router_decisions",
            "Routing decisions by reason (affinity, load, cold, fallback)",
            ["policy", "reason"],
            registry=r,
        )
        for reason in REASONS:
            self.decisions.labels(policy, reason)  # export zeros, so rates exist from the start
        self.estimated_ttft = Histogram(
            "kvpilot_router_estimated_ttft_seconds",
            "Time to first token the router estimated for the replica it chose",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.observed_ttft = Histogram(
            "kvpilot_router_observed_ttft_seconds",
            "Time from sending a request upstream to its first response byte",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "kvpilot_router_routing_overhead_seconds",
            "Time from a request's arrival to its upstream request going out to the chosen replica",
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.in_flight = InFlight()
        r.register(self.in_flight)
        self.retries = Counter(
            "kvpilot_router_retries",
            "Requests retried on another replica after the first failed before any byte reached the client",
            registry=r,
        )
        self.ejections = Counter(
            "kvpilot_router_ejections",
            "Replicas taken out of routing, by reason (error, timeout, not_ready)",
            ["replica", "reason"],
            registry=r,
        )
        self.routable = Gauge(
            "kvpilot_router_routable_replicas", "Replicas ready and not ejected", registry=r
        )
        self.known = Gauge("kvpilot_router_replicas", "Replicas discovered", registry=r)
        self.kv_resyncs = Counter(
            "kvpilot_router_kv_resyncs",
            "Prefix-index resyncs from /kv/snapshot (start, gap, new epoch)",
            ["replica"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvpilot_router_prompt_tokens", "Prompt tokens of cache-aware routed requests", registry=r
        )
        self.cached_prompt_tokens = Counter(
            "kvpilot_router_cached_prompt_tokens",
            "Prompt tokens the chosen replica held in its prefix cache when the request was routed",
            registry=r,
        )
        self.responses = Counter(
            "kvpilot_router_responses", "Responses to clients by status code", ["code"], registry=r
        )

    def forget_replica(self, url: str) -> None:
        """Drop a removed replica's labelled series (keeps cardinality bounded as pods come and go)."""
        with contextlib.suppress(KeyError):
            self.kv_resyncs.remove(url)
        for labels in [s.labels for m in self.ejections.collect() for s in m.samples]:
            if labels.get("replica") == url:
                with contextlib.suppress(KeyError):
                    self.ejections.remove(url, labels["reason"])

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class InFlight(Collector):
    """``kvpilot_router_in_flight_requests``, read from the replicas at each scrape rather than counted up
    and down: a replica removed (or removed and added again) while its requests run can neither keep a
    series nor go below zero."""

    def __init__(self) -> None:
        #: (replica URL, requests in flight there) of every replica in the fleet; set by the fleet
        self.source: Callable[[], Iterable[tuple[str, int]]] = lambda: ()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "kvpilot_router_in_flight_requests",
            "Requests this router has in flight, per replica",
            labels=["replica"],
        )
        for url, count in self.source():
            family.add_metric([url], count)
        yield family
