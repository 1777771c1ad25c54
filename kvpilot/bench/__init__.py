"""kvpilot.bench — benchmark tools behind ``kvpilot bench``.

Package map (one responsibility per module):
- ``cli``              ``kvpilot bench`` argparse assembly; one module per subcommand
- ``serve_cli``        ``bench serve`` flags -> config -> run -> tables / JSON / plots, exit codes
- ``offline_cli``      ``bench offline``: engine-only batch throughput (no HTTP), seeded token workloads
- ``config``           typed, documented, validated configuration dataclasses
- ``arrivals``         open-loop arrival schedules (Poisson / gamma with burstiness), seeded
- ``wordlist``         tokenizer-independent prompt text (one word ≈ one token)
- ``workloads``        request streams: random lengths, shared-prefix tenants, ShareGPT file
- ``sharegpt``         reading ShareGPT-style conversation files
- ``sse_client``       one streaming request over aiohttp, timestamped, errors classified
- ``records``          the per-request record and the metric definitions (TTFT, ITL, TPOT, E2E)
- ``load_generation``  open loop on a schedule, closed loop with N clients, warm-up
- ``endpoint``         readiness polling and model discovery before the load
- ``context_fit``      prompt tokens a word measured on the endpoint; lengths scaled to its context
- ``client_overhead``  event-loop lag and CPU use of the load generator itself
- ``metrics``          per-point aggregation: percentiles, throughputs, SLO attainment, goodput
- ``saturation``       the sweep's saturation rule
- ``runner``           the whole benchmark: ready -> model -> warm-up -> load points -> saturation
- ``report_text``      the human-readable tables
- ``report_json``      the JSON report (definitions, figures, per-request records)
- ``plots``            PNG plots: latency vs achieved throughput, latency CDFs
- ``compare/``         kvpilot side by side with vLLM's CPU build and HF ``generate`` (its own map)
"""
