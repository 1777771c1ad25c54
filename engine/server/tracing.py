"""OpenTelemetry: one span per engine request, with an event per phase of its life
(docs/architecture.md#data-path).

Events: ``queued`` (accepted; KV reservation made, or waiting for headroom), ``kv_reserved`` (left the
pending-admission queue), ``admitted`` (the scheduler allocated its blocks; ``cached_tokens``),
``prefill_chunk`` (each forward over a piece of the prompt), ``preempted``, ``first_token`` (first emit),
``finished`` (``finish_reason``). The span starts at the request's arrival and joins the caller's trace
when the request carries a W3C ``traceparent`` header.

Spans are exported by OTLP/HTTP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``) is set;
the exporter reads the standard ``OTEL_*`` variables itself. Without it, no span is created at all.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import propagate
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

SERVICE_NAME = "kvpilot-engine"
INSTRUMENTATION_NAME = "kvpilot.engine.server"
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def tracer_provider_from_env() -> TracerProvider | None:
    """An OTLP-exporting provider when the environment configures an endpoint, else None (no tracing)."""
    if not any(os.environ.get(name) for name in ENDPOINT_VARIABLES):
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    defaults = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": SERVICE_NAME}
    provider = TracerProvider(resource=Resource.create(defaults))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


class RequestSpan:
    """A request's span, safe to use from the engine thread and the event loop; a no-op without a tracer.
    Events after the end are dropped quietly (a cancelled request's last prefill chunk may race its end)."""

    def __init__(
        self,
        tracer: Tracer | None,
        name: str,
        start_ns: int,
        attributes: Mapping[str, Any],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._ended = tracer is None
        self._span: Span | None = None
        if tracer is not None:
            parent = propagate.extract(dict(headers)) if headers else None
            self._span = tracer.start_span(
                name, context=parent, kind=SpanKind.SERVER, start_time=start_ns, attributes=dict(attributes)
            )

    def event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        with self._lock:
            if not self._ended and self._span is not None:
                self._span.add_event(name, dict(attributes or {}), timestamp=time.time_ns())

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        with self._lock:
            if not self._ended and self._span is not None:
                self._span.set_attributes({k: v for k, v in attributes.items() if v is not None})

    def end(self, error: str | None = None) -> None:
        with self._lock:
            if self._ended or self._span is None:
                return
            self._ended = True
            if error is not None:
                self._span.set_status(Status(StatusCode.ERROR, error))
            self._span.end()


NO_SPAN = RequestSpan(None, "", 0, {})
