"""``kvpilot bench serve``: flags -> :class:`ServeBenchConfig` -> run -> tables, JSON and plots.

Exit codes: 0 done, 1 endpoint unusable (unreachable, not ready, no model, every warm-up request failed),
2 bad flags or dataset, 3 the endpoint refused requests as invalid or a load point had no success (the
report is still written, its figures are no measurement), 130 interrupted.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from kvpilot.bench.config import (
    API_KINDS,
    SATURATION_LATENCIES,
    WORKLOAD_KINDS,
    ConfigError,
    EndpointConfig,
    LoadConfig,
    SaturationRule,
    ServeBenchConfig,
    SLOConfig,
    WorkloadConfig,
    length_range,
    levels_list,
    rates_list,
)
from kvpilot.bench.context_fit import describe_fit
from kvpilot.bench.endpoint import EndpointError
from kvpilot.bench.report_json import report_dict, write_report
from kvpilot.bench.report_text import format_cold_start, format_point, format_sweep, refusals
from kvpilot.bench.runner import PointResult, run_serve_benchmark_sync
from kvpilot.bench.sharegpt import DatasetError

NAME = "serve"
HELP = "load-test an OpenAI-compatible endpoint (TTFT, TPOT, ITL, E2E, throughput, goodput)"
DESCRIPTION = (
    "Drive any OpenAI-compatible streaming endpoint with open-loop (Poisson/gamma) or closed-loop load, "
    "measure latency from each request's scheduled arrival, and report latency percentiles, three kinds "
    "of throughput, SLO attainment and goodput. Several --request-rate or --concurrency values make a "
    "sweep that also finds the saturation point."
)
DEFAULT_NUM_REQUESTS = 200


def add_arguments(parser: argparse.ArgumentParser) -> None:
    ep = parser.add_argument_group("endpoint")
    ep.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    ep.add_argument(
        "--api", choices=API_KINDS, default="completions", help="/v1/completions or /v1/chat/completions"
    )
    ep.add_argument("--model", help="model name to request (default: first id in /v1/models)")
    # The environment default is resolved later so --help never prints a secret.
    ep.add_argument("--api-key", help="bearer token (default: $OPENAI_API_KEY when set)")
    ep.add_argument("--request-timeout", type=float, default=600.0, metavar="S", help="per request, seconds")
    ep.add_argument("--connect-timeout", type=float, default=10.0, metavar="S", help="TCP connect, seconds")
    ep.add_argument("--no-keep-alive", action="store_true", help="a new connection per request")
    ready = ep.add_mutually_exclusive_group()
    ready.add_argument("--ready-url", help="poll this URL until HTTP 200 first and report time-to-ready")
    ready.add_argument("--wait-ready", action="store_true", help="poll BASE_URL/ready (kvpilot's)")
    ep.add_argument("--ready-timeout", type=float, default=600.0, metavar="S", help="give up polling after")
    ep.add_argument(
        "--no-usage",
        action="store_true",
        help="do not send stream_options.include_usage (then tokens are counted from chunks)",
    )
    ep.add_argument("--ignore-eos", action="store_true", help="send ignore_eos=true (vLLM extra param)")
    ep.add_argument(
        "--min-tokens-equal-max",
        action="store_true",
        help="send min_tokens=max_tokens (vLLM extra param) to fix output lengths",
    )
    ep.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")

    load = parser.add_argument_group("load (open loop by default)")
    mode = load.add_mutually_exclusive_group()
    mode.add_argument(
        "--request-rate",
        type=rates_list,
        default=(math.inf,),
        metavar="R[,R...]",
        help="open loop: mean arrivals per second, 'inf' = all at once; a list is a sweep (default: inf)",
    )
    mode.add_argument(
        "--concurrency",
        type=levels_list,
        metavar="C[,C...]",
        help="closed loop: clients each keeping one request in flight; a list is a sweep",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of inter-arrival gaps: 1 = Poisson, <1 burstier, >1 more regular",
    )
    load.add_argument(
        "--max-concurrency",
        type=int,
        metavar="N",
        help="open loop: client-side cap on requests in flight (waiting counts as latency)",
    )
    load.add_argument(
        "--num-requests",
        type=int,
        metavar="N",
        help=f"measured requests per load point (default {DEFAULT_NUM_REQUESTS} without --duration)",
    )
    load.add_argument("--duration", type=float, metavar="S", help="stop issuing requests after S seconds")
    load.add_argument(
        "--warmup-requests",
        type=int,
        default=2,
        metavar="N",
        help="sequential requests before measuring; excluded, reported as cold start",
    )

    wl = parser.add_argument_group("workload")
    wl.add_argument(
        "--workload",
        choices=WORKLOAD_KINDS,
        default="random",
        help="random lengths, shared-prefix tenants, or a ShareGPT file",
    )
    wl.add_argument(
        "--input-len",
        type=length_range,
        default=(128, 512),
        metavar="MIN:MAX",
        help="prompt length in words (≈ tokens), uniform (default: 128:512)",
    )
    wl.add_argument(
        "--output-len",
        type=length_range,
        default=(32, 128),
        metavar="MIN:MAX",
        help="max_tokens, uniform (default: 32:128)",
    )
    wl.add_argument("--num-tenants", type=int, default=4, help="shared-prefix: tenants")
    wl.add_argument(
        "--system-prompt-len",
        type=int,
        default=1024,
        metavar="WORDS",
        help="shared-prefix: words of each tenant's shared system prompt",
    )
    wl.add_argument("--dataset-path", type=Path, help="sharegpt: JSON file of conversations")
    wl.add_argument(
        "--sharegpt-output-cap",
        type=int,
        default=1024,
        metavar="N",
        help="sharegpt: max_tokens = min(words of the recorded answer, N)",
    )
    wl.add_argument(
        "--no-context-fit",
        action="store_true",
        help="send the lengths as given even where they exceed the max_model_len /v1/models reports",
    )

    slo = parser.add_argument_group("SLO and saturation")
    slo.add_argument("--slo-ttft", type=float, metavar="S", help="TTFT SLO in seconds")
    slo.add_argument("--slo-tpot", type=float, metavar="S", help="TPOT SLO in seconds")
    slo.add_argument(
        "--saturation-latency",
        choices=SATURATION_LATENCIES,
        default="ttft_p50",
        metavar="NAME",
        help="latency figure the saturation rule watches: {ttft,tpot,itl,e2e}_{p50,p90,p99}",
    )
    slo.add_argument(
        "--saturation-latency-factor",
        type=float,
        default=2.0,
        help="saturated once that latency exceeds this multiple of its lowest-load value",
    )
    slo.add_argument(
        "--saturation-min-gain",
        type=float,
        default=0.05,
        help="... or achieved req/s rises by less than this fraction between sweep points",
    )

    out = parser.add_argument_group("output")
    out.add_argument("--seed", type=int, default=0, help="seeds arrivals and prompts")
    out.add_argument("--output-json", type=Path, metavar="PATH", help="full report incl. per-request records")
    out.add_argument(
        "--plot-dir", type=Path, metavar="DIR", help="write throughput-latency and CDF PNGs here"
    )
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    """The validated config; raises ConfigError with a message naming the flag."""
    ready_url = args.ready_url
    if args.wait_ready:
        ready_url = args.base_url.rstrip("/") + "/ready"
    num_requests = args.num_requests
    if num_requests is None and args.duration is None:
        num_requests = DEFAULT_NUM_REQUESTS
    closed = args.concurrency is not None
    config = ServeBenchConfig(
        endpoint=EndpointConfig(
            base_url=args.base_url,
            api=args.api,
            model=args.model,
            api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
            request_timeout_s=args.request_timeout,
            connect_timeout_s=args.connect_timeout,
            keep_alive=not args.no_keep_alive,
            ready_url=ready_url,
            ready_timeout_s=args.ready_timeout,
            include_usage=not args.no_usage,
            ignore_eos=args.ignore_eos,
            min_tokens_equal_max=args.min_tokens_equal_max,
            temperature=args.temperature,
        ),
        load=LoadConfig(
            mode="closed" if closed else "open",
            request_rates=() if closed else args.request_rate,
            concurrencies=args.concurrency if closed else (),
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            num_requests=num_requests,
            duration_s=args.duration,
            warmup_requests=args.warmup_requests,
        ),
        workload=WorkloadConfig(
            kind=args.workload,
            input_len_range=args.input_len,
            output_len_range=args.output_len,
            num_tenants=args.num_tenants,
            system_prompt_len=args.system_prompt_len,
            dataset_path=args.dataset_path,
            sharegpt_output_cap=args.sharegpt_output_cap,
            fit_context=not args.no_context_fit,
        ),
        slo=SLOConfig(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot),
        saturation=SaturationRule(
            latency=args.saturation_latency,
            latency_factor=args.saturation_latency_factor,
            min_throughput_gain=args.saturation_min_gain,
        ),
        seed=args.seed,
        output_json=args.output_json,
        plot_dir=args.plot_dir,
        show_progress=not args.no_progress,
    )
    if closed and args.max_concurrency is not None:
        raise ConfigError("--max-concurrency caps open-loop load; with --concurrency it has no meaning")
    if closed and args.burstiness != 1.0:
        raise ConfigError("--burstiness shapes open-loop arrivals; with --concurrency it has no meaning")
    config.validate()
    return config


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        parser.error(str(exc))

    def show_point(point: PointResult) -> None:
        print(format_point(point) + "\n", flush=True)

    endpoint = config.endpoint
    print(f"kvpilot bench serve -> {endpoint.base_url.rstrip('/')}{endpoint.request_path}", file=sys.stderr)
    try:
        result = run_serve_benchmark_sync(config, on_point=show_point)
    except DatasetError as exc:
        parser.error(str(exc))
    except EndpointError as exc:
        print(f"kvpilot bench serve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvpilot bench serve: interrupted; no report written", file=sys.stderr)
        return 130

    print(f"model       {result.model}")
    if result.context_fit is not None:
        print(f"context     {describe_fit(result.context_fit, config.workload)}")
    print(format_cold_start(result.cold_start, result.points[0].summary if result.points else None))
    if result.saturation is not None:
        print("\n" + format_sweep(result.points, result.saturation, config))
    plots: list[Path] = []
    try:  # the paths were checked before the run; a write can still fail (a full disk, a path like /proc)
        if config.plot_dir is not None:
            from kvpilot.bench.plots import write_plots  # matplotlib is slow to import; only when plotting

            plots = write_plots(result.points, result.saturation, config.plot_dir)
            print("\nplots       " + ", ".join(str(path) for path in plots))
        elif result.saturation is not None:
            print("\n(pass --plot-dir DIR to draw throughput-vs-latency and latency-CDF plots)")
        if config.output_json is not None:
            write_report(config.output_json, report_dict(config, result, plots))
            print(f"report      {config.output_json}")
    except OSError as exc:
        print(f"kvpilot bench serve: error: cannot write the results: {exc}", file=sys.stderr)
        return 1
    if problem := refusals(result):
        print(f"kvpilot bench serve: error: {problem}; the figures above are no measurement", file=sys.stderr)
        return 3
    return 0
