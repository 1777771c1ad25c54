"""Prometheus metrics of one engine server (``/metrics``; names, definitions and the vLLM mapping are in
docs/metrics.md). Prefix ``kvpilot_``, units in names, counters end in ``_total``, label ``model_name``.

Three writers, all thread-safe through prometheus_client: the engine thread (token, prefix-cache and
preemption counters from engine-stat deltas; queue/prefill/decode times from terminal records), the HTTP
handlers (per-request latencies at emit time, finished/SLO counters, rejections) and the lifecycle
(startup phases). Gauges are not stored: a collector (``load_gauges``) reads the engine loop's latest
``/load`` snapshot at scrape time, so they can never disagree with ``/load``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvpilot.engine.server.load_gauges import LoadGauges
from kvpilot.engine.server.spec_decode_metrics import SpecDecodeMetrics
from kvpilot.engine.server.structured_metrics import StructuredMetrics

_Family = TypeVar("_Family", Counter, Histogram)

# Buckets: vLLM's, extended downwards (a small model on CPU decodes in a few ms per token).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TOKEN_GAP_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_TIME_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
STARTUP_PHASES = ("loading", "warming_up", "kernel_tuning", "graph_capture")
FINISH_REASONS = ("stop", "length", "abort", "timeout", "error")
STARTUP_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


def with_objective(buckets: tuple[float, ...], objective: float | None) -> tuple[float, ...]:
    """Add the SLO itself as a bucket bound, so attainment can also be read off the histogram exactly."""
    return buckets if objective is None else tuple(sorted(set(buckets) | {objective}))


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        slo_ttft_s: float | None = None,
        slo_tpot_s: float | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.model_name = m = model_name
        name = ["model_name"]

        def counter(metric: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(metric, doc, [*name, *labels], registry=r)

        def histogram(
            metric: str, doc: str, buckets: Sequence[float], labels: tuple[str, ...] = ()
        ) -> Histogram:
            return Histogram(metric, doc, [*name, *labels], registry=r, buckets=buckets)

        def one(family: _Family) -> _Family:  # the family's only series (label model_name)
            return family.labels(m)

        # engine work (engine thread)
        self.prompt_tokens = one(
            counter("kvpilot_prompt_tokens_total", "Prompt tokens computed (prefix-cache hits excluded).")
        )
        self.generation_tokens = one(counter("kvpilot_generation_tokens_total", "Output tokens generated."))
        self.prefix_queries = one(
            counter(
                "kvpilot_prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache at first scheduling.",
            )
        )
        self.prefix_hits = one(
            counter("kvpilot_prefix_cache_hits_total", "Prompt tokens served from the prefix cache.")
        )
        self.preemptions = one(
            counter("kvpilot_num_preemptions_total", "Requests preempted to free KV blocks.")
        )
        self.queue_time = one(
            histogram(
                "kvpilot_request_queue_time_seconds",
                "Arrival at the server to first scheduling.",
                REQUEST_TIME_BUCKETS,
            )
        )
        self.prefill_time = one(
            histogram(
                "kvpilot_request_prefill_time_seconds",
                "First scheduling to the first generated token.",
                REQUEST_TIME_BUCKETS,
            )
        )
        self.decode_time = one(
            histogram(
                "kvpilot_request_decode_time_seconds",
                "First generated token to the end.",
                REQUEST_TIME_BUCKETS,
            )
        )
        # per request, as the client sees it (HTTP handlers)
        self.ttft = one(
            histogram(
                "kvpilot_time_to_first_token_seconds",
                "TTFT: first emit minus arrival.",
                with_objective(TTFT_BUCKETS, slo_ttft_s),
            )
        )
        self.itl = one(
            histogram(
                "kvpilot_inter_token_latency_seconds",
                "ITL: emit time of a token minus the previous one's.",
                TOKEN_GAP_BUCKETS,
            )
        )
        self.tpot = one(
            histogram(
                "kvpilot_time_per_output_token_seconds",
                "TPOT: (last emit - first emit) / (N - 1).",
                with_objective(TOKEN_GAP_BUCKETS, slo_tpot_s),
            )
        )
        self.e2e = one(
            histogram(
                "kvpilot_e2e_request_latency_seconds",
                "Arrival to the end of the response.",
                REQUEST_TIME_BUCKETS,
            )
        )
        self.prompt_len = one(
            histogram(
                "kvpilot_request_prompt_tokens", "Prompt length of completed requests.", TOKEN_COUNT_BUCKETS
            )
        )
        self.output_len = one(
            histogram(
                "kvpilot_request_generation_tokens",
                "Output tokens of completed requests.",
                TOKEN_COUNT_BUCKETS,
            )
        )
        self._finished = counter(
            "kvpilot_requests_finished_total",
            "Accepted requests that ended, by finish reason.",
            ("finished_reason",),
        )
        self.slo_attained = one(
            counter(
                "kvpilot_slo_attained_requests_total",
                "Finished requests that completed and met every configured SLO.",
            )
        )
        self.slo_attained_tokens = one(
            counter(
                "kvpilot_slo_attained_generation_tokens_total",
                "Output tokens of the requests counted as SLO-attained.",
            )
        )
        self._rejected = counter(
            "kvpilot_requests_rejected_total", "Error responses, by error code.", ("reason",)
        )
        for shed in ("queue_full", "queue_timeout"):  # the shedding alert's rate() needs them from 0
            self._rejected.labels(self.model_name, shed)
        self.degraded = one(
            counter(
                "kvpilot_requests_degraded_total",
                "Requests admitted with best_of shrunk to n to fit the KV headroom.",
            )
        )
        self.backpressure_pauses = one(
            counter(
                "kvpilot_backpressure_pauses_total", "Times a request was paused: its client was not reading."
            )
        )
        self.left_before_engine = one(
            counter(
                "kvpilot_requests_abandoned_total",
                "Inference requests whose client disconnected before the request reached the engine "
                "(while its body was arriving).",
            )
        )
        self._startup = histogram(
            "kvpilot_startup_phase_seconds",
            "Duration of a startup phase (loading, warming_up, kernel_tuning, graph_capture).",
            STARTUP_BUCKETS,
            ("phase",),
        )
        #: structured outputs: requests by kind, compile time, the sampler's mask cost
        self.structured = StructuredMetrics(r, m)
        #: speculative decoding: drafts, accepted tokens, acceptance length
        self.spec_decode = SpecDecodeMetrics(r, m)
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        # Series that exist from the first scrape at 0, so rate()/increase() see them start, not appear at 1
        # (/metrics is served while the model still loads).
        for phase in STARTUP_PHASES:
            self._startup.labels(m, phase)
        for reason in FINISH_REASONS:
            self._finished.labels(m, reason)

    def finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def startup_phase(self, phase: str, seconds: float) -> None:
        self._startup.labels(self.model_name, phase).observe(seconds)

    def attach_gauges(self, load: Callable[[], dict], phase: Callable[[], str]) -> None:
        self.registry.register(LoadGauges(self, load, phase))
