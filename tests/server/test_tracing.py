"""OpenTelemetry: one span per engine request, its phase events in order, GenAI attributes, the caller's
trace joined through ``traceparent``; and OTLP export switched on by the environment alone."""

from __future__ import annotations

import http.server
import threading

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from polling import wait_until

from kvpilot.engine.server.config import ServerConfig, WarmupBucket
from kvpilot.engine.server.tracing import tracer_provider_from_env

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def wait_spans(exporter: InMemorySpanExporter, count: int):
    wait_until(lambda: len(exporter.get_finished_spans()) >= count, 5, f"{count} finished span(s)")
    return exporter.get_finished_spans()


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


@pytest.fixture
def collector():
    """A local OTLP/HTTP trace collector: the (path, content type, body) of every POST it receives."""
    received: list[tuple[str, str, bytes]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, self.headers["Content-Type"], body))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", received
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    ("variable", "path"),
    [("OTEL_EXPORTER_OTLP_ENDPOINT", ""), ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "/v1/traces")],
)
def test_otlp_export_follows_the_environment(monkeypatch, collector, variable, path):
    url, received = collector
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    assert tracer_provider_from_env() is None
    monkeypatch.setenv(
        variable, url + path
    )  # the generic variable is a base URL, the traces one the full URL
    provider = tracer_provider_from_env()
    try:
        provider.get_tracer("test").start_span("probe").end()
        assert provider.force_flush(10_000)
    finally:
        provider.shutdown()
    ((where, content_type, body),) = received
    assert (where, content_type) == ("/v1/traces", "application/x-protobuf")
    (resource_spans,) = ExportTraceServiceRequest.FromString(body).resource_spans
    service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"]
    assert service == "kvpilot-engine"
    assert [s.name for scope in resource_spans.scope_spans for s in scope.spans] == ["probe"]
