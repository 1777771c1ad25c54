"""Structured-output metrics (docs/metrics.md, docs/architecture.md#structured-outputs): requests by the kind
of their constraint (handlers), grammar compile time (the compiler's threads) and the sampler's grammar
stage, as seconds and masked token positions (engine-stat deltas on the engine thread; their ratio is the
mask time per token)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

#: the constraint kinds (``StructuredOutputsParams.kind``) and ``tool_calls`` (a forced tool call)
KINDS = ("json", "json_object", "regex", "choice", "grammar", "tool_calls")
COMPILE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class StructuredMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self._model = model_name
        self._requests = Counter(
            "kvpilot_structured_output_requests_total",
            "Requests generated under a grammar, by the kind of constraint.",
            ["model_name", "kind"],
            registry=registry,
        )
        for kind in KINDS:
            self._requests.labels(model_name, kind)
        self._compile = Histogram(
            "kvpilot_grammar_compile_seconds",
            "Time to compile one grammar (cache misses only), by kind.",
            ["model_name", "kind"],
            registry=registry,
            buckets=COMPILE_BUCKETS,
        )
        self.mask_seconds = Counter(
            "kvpilot_grammar_mask_seconds_total",
            "Seconds the sampler spent filling and applying grammar masks.",
            ["model_name"],
            registry=registry,
        ).labels(model_name)
        self.masked_tokens = Counter(
            "kvpilot_grammar_masked_tokens_total",
            "Token positions sampled under a grammar mask (one per constrained row per step).",
            ["model_name"],
            registry=registry,
        ).labels(model_name)

    def request(self, kind: str) -> None:
        self._requests.labels(self._model, kind).inc()

    def compiled(self, kind: str, seconds: float) -> None:
        self._compile.labels(self._model, kind).observe(seconds)
