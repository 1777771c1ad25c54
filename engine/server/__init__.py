"""kvpilot.engine.server — the OpenAI-compatible engine server (``kvpilot serve``; docs/serving.md).

Threads: the asyncio event loop (uvicorn: HTTP, SSE, probes) and one engine-loop thread, the only code
that touches the engine. Handlers send it commands; it sends each request's output back through a
bounded per-request stream.

Package map (request path first):
- ``cli``               flags (vLLM engine flags + server flags) → configs → ``runner.serve``
- ``config``            ``ServerConfig``: the server's options, validated at the boundary
- ``runner``            uvicorn with drain-on-SIGTERM; exit status
- ``http_protocol``     uvicorn's HTTP protocol: connection bounds, a JSON 400 for unparsable requests
- ``connection``        per-connection byte bounds (SO_SNDBUF, write buffer), stall timeout; the router's too
- ``app``               builds the shared state and the FastAPI app
- ``state``             ``ServerState`` (what handlers share) and ``RequestContext`` (arrival, tenant)
- ``ingress``           ingress gate: API key, readiness, body size, tenant token bucket — before parsing
- ``body_encoding``     a request body's Content-Encoding (gzip, deflate) undone within the body limit
- ``rate_limit``        per-tenant token buckets
- ``protocol``          request bodies (pydantic), strict; OpenAI fields + vLLM's extra sampling params
- ``prompts``           body → prompt token ids, by the router's rules and shared functions
- ``sampling_mapping``  body → ``SamplingParams``; checks against the loaded engine's limits
- ``structured_fields`` ``response_format`` / ``structured_outputs`` / ``guided_*`` → one constraint, compiled
                        before queueing (a 400 names an unsupported JSON-schema keyword)
- ``tool_calls``        ``tools`` and ``tool_choice``: validation; the grammar of ``required`` and named calls
- ``tool_parsers``      the model's tool-call text → OpenAI ``tool_calls`` and their stream deltas
- ``tool_call_scan``    reading that text as it grows: JSON extents, the calls so far, tags outside strings
- ``completions``       ``POST /v1/completions`` and its response/stream shapes
- ``chat``              ``POST /v1/chat/completions`` and its response/stream shapes
- ``logprobs_format``   engine logprobs in OpenAI's completions and chat shapes
- ``responses``         Generation → JSON or SSE response; first byte = first token; errors mid-stream
- ``disconnect``        client-disconnect detection (before and during a response)
- ``generation``        one HTTP request's engine requests: submit, take chunks, time emits, account once
- ``request_timeline``  emit times → TTFT / ITL / TPOT / E2E and SLO attainment (docs/metrics.md)
- ``request_stream``    bounded engine-thread → handler hand-off that drives backpressure
- ``serving_request``   one engine request as the server tracks it; ``Failure``
- ``engine_loop``       the engine thread: load, warm up, then commands → admission → step → outputs
- ``loop_commands``     the commands handlers send the engine thread; the KV snapshot it answers
- ``engine_info``       immutable facts of the loaded engine; ``/load`` before the engine exists
- ``admission``         exact admission after prefix lookup: KV reservation, bounded queue, deadline, degrade
- ``output_deltas``     cumulative engine outputs → per-chunk deltas (on the engine thread)
- ``engine_telemetry``  engine-stat deltas, schedule events and terminal records → metrics and spans
- ``warmup``            warm-up passes over batch/length buckets and kernel tuning before ``/ready``
- ``lifecycle``         phases loading → warming_up → ready → draining (/ready) and startup timings
- ``drain``             the SIGTERM drain sequence
- ``metrics``           Prometheus metrics (docs/metrics.md)
- ``load_gauges``       its gauges, read at scrape time from the ``/load`` snapshot and the phase
- ``structured_metrics`` structured-output metrics: requests by kind, grammar compile time, mask cost
- ``spec_decode_metrics`` speculative-decoding metrics: drafts, accepted tokens by position, acceptance
                         length
- ``tracing``           OpenTelemetry: a span per request with phase events; OTLP export from the env
- ``errors``            OpenAI error objects and the app's exception handlers
- ``ops_routes``        ``/health``, ``/ready``, ``/load``, ``/metrics``, ``/v1/models``
- ``kv_routes``         ``/kv/events``, ``/kv/snapshot``
"""
