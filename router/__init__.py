"""kvpilot.router — the cache-aware routing sidecar (``kvpilot router``).

It proxies the OpenAI endpoints to the engine replica with the lowest estimated completion cost, not the
highest cache hit rate: queued prefill plus this request's uncached prompt tokens, over the replica's
learned prefill rate, plus a decode term, among replicas with KV headroom (see ``scoring``).

Package map:
- ``config``            typed, validated configuration (policy, weights, polling, timeouts, discovery)
- ``cli``               ``kvpilot router`` flags → config → server
- ``server``            runs the app on a port (in-process or until SIGTERM); loads the shared tokenizer
- ``connections``       client connections: stream byte bounds, stall timeout, JSON for unparsable requests
- ``app``               HTTP surface: proxied endpoints, ``/health``, ``/ready``, ``/metrics``; retry loop
- ``proxy``             forwards one request to one replica, streaming, retryable until the first byte
- ``upstream_failure``  a failure before the first byte: whose fault it is, what the client is told
- ``sse_events``        cuts an upstream SSE stream after its complete events, holding a bounded rest
- ``upstream``          aiohttp client of the proxied requests: a keep-alive session per replica
- ``errors``            OpenAI-style JSON error responses; middleware that turns every other error into one
- ``json_body``         request body → JSON (Content-Encoding undone as by the engine; orjson, then ``json``)
- ``request_profile``   request → tenant, prompt token ids (shared engine functions), output budget
- ``segment_tokenizer`` exact per-segment token cache for rendered chat prompts
- ``block_chain``       a prompt's block hashes (shared engine hash), lazily up to the first miss
- ``scoring``           pure policy functions: cost, headroom filter, hot-spot guard, rendezvous ties
- ``picker``            applies the policy to live replica state
- ``replica``           per-replica state: readiness, last ``/load``, cached hashes, in-flight requests
- ``sent_prompts``      prompts this router sent to a replica, counted as cached before its events say so
- ``engine_load``       typed ``/load`` snapshot
- ``prefix_index``      a replica's exact cached-hash set from ``/kv/events`` and ``/kv/snapshot``
- ``prefill_rate``      a replica's prefill rate: engine-measured, else learned from observed first bytes
- ``poller``            polls one replica; ejects on failure, re-admits when ready, resyncs its index
- ``fleet``             the replica set following discovery; replica metrics
- ``endpointslices``    Kubernetes EndpointSlice list/watch (official client) → endpoints
- ``metrics``           ``kvpilot_router_*`` Prometheus metrics

Nothing here imports torch: the router shares only the engine's torch-free modules (tokenizer, prompt
rendering, tenancy, block hash, model registry, the server's connection bounds).
"""
