"""OpenTelemetry: one span per engine request, its phase events in order, GenAI attributes, the caller's
trace joined through ``traceparent``; and OTLP export switched on by the environment alone."""

from __future__ import annotations

import time

import httpx
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from kvpilot.engine.server.config import ServerConfig, WarmupBucket
from kvpilot.engine.server.tracing import tracer_provider_from_env

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def wait_spans(exporter: InMemorySpanExporter, count: int):
    deadline = time.monotonic() + 5
    while len(spans := exporter.get_finished_spans()) < count:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return spans


def traced_server(start_in_process, engine_args: dict, config: ServerConfig | None = None):
    """An in-process server whose spans land in the returned in-memory exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return start_in_process(engine_args, config, tracer_provider=provider), exporter


def test_a_span_per_request_with_phase_events(start_in_process):
    config = ServerConfig(warmup_buckets=(WarmupBucket(1, 8),), trace_user=True)
    # a 20-token budget splits the 50-token prompt into three prefill chunks
    server, exporter = traced_server(
        start_in_process, {"max_num_batched_tokens": 20, "max_num_seqs": 4}, config
    )
    body = {"prompt": list(range(5, 55)), "max_tokens": 3, "ignore_eos": True, "user": "u-1"}
    r = httpx.post(
        server.url + "/v1/completions",
        json=body,
        headers={"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01", "x-tenant": "acme"},
    )
    assert r.status_code == 200
    (span,) = wait_spans(exporter, 1)
    assert span.name == "text_completion tiny-random" and format(span.context.trace_id, "032x") == TRACE_ID
    names = [e.name for e in span.events]
    assert names == [
        "queued",
        "admitted",
        "prefill_chunk",
        "prefill_chunk",
        "prefill_chunk",
        "first_token",
        "finished",
    ]
    chunks = [dict(e.attributes) for e in span.events if e.name == "prefill_chunk"]
    assert chunks == [{"start": 0, "tokens": 20}, {"start": 20, "tokens": 20}, {"start": 40, "tokens": 10}]
    assert dict(span.events[0].attributes) == {
        "prompt_tokens": 50,
        "kv_blocks": 4,
        "reserved": True,
        "degraded": False,
    }
    assert dict(span.events[-1].attributes) == {"finish_reason": "length"}
    a = span.attributes
    assert (
        a["gen_ai.operation.name"],
        a["gen_ai.request.model"],
        a["gen_ai.usage.input_tokens"],
        a["gen_ai.usage.output_tokens"],
        a["gen_ai.response.finish_reasons"],
        a["enduser.id"],
        a["kvpilot.tenant"],
    ) == ("text_completion", "tiny-random", 50, 3, ("length",), "u-1", "acme")
    assert span.status.status_code is StatusCode.UNSET
    stamps = [e.timestamp for e in span.events]
    assert span.start_time <= stamps[0] and stamps == sorted(stamps) and stamps[-1] <= span.end_time


def test_a_rejected_request_ends_its_span_with_an_error(start_in_process):
    server, exporter = traced_server(start_in_process, {"num_kv_blocks": 8})
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "n": 20, "max_tokens": 2},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "exceeds_kv_capacity"
    (span,) = wait_spans(exporter, 1)
    assert span.name == "chat tiny-random" and span.status.status_code is StatusCode.ERROR
    assert [e.name for e in span.events] == ["finished"]
    assert span.events[0].attributes["finish_reason"] == "rejected"


def test_security_the_user_field_is_not_exported_by_default(start_in_process):
    """``user`` is often an e-mail address: it reaches the span only with ``--trace-user``."""
    server, exporter = traced_server(start_in_process, {"num_kv_blocks": 64})
    r = httpx.post(
        server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "user": "someone@example.com"}
    )
    assert r.status_code == 200
    (span,) = wait_spans(exporter, 1)
    assert span.attributes["enduser.id"] == ""


def test_otlp_export_follows_the_environment(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert tracer_provider_from_env() is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    provider = tracer_provider_from_env()
    try:
        assert provider.resource.attributes["service.name"] == "kvpilot-engine"
        (processor,) = provider._active_span_processor._span_processors
        assert type(processor.span_exporter).__name__ == "OTLPSpanExporter"
    finally:
        provider.shutdown()
