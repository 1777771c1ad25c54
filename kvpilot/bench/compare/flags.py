"""The side-by-side comparison's flags: the parser, which systems run, and the validated ``ComparePlan``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvpilot.bench.compare.plan import ComparePlan, PlanError
from kvpilot.bench.compare.vllm_install import DEFAULT_VENV
from kvpilot.bench.config import length_range

SYSTEMS = ("hf", "vllm", "llamacpp", "kvpilot")  # run order: the floor first, then one server at a time
OPT_IN = ("llamacpp",)  # run when named (--only) or when --llama-server gives the binary
REPO = Path(__file__).resolve().parents[3]  # kvpilot/bench/compare/ -> the repository
DEFAULT_RESULTS = REPO / "bench" / "results" / "compare_vllm"
QUICK = {
    "concurrencies": (1, 8),
    "request_rates": (0.5, 1.0),
    "min_requests": 4,
    "rounds_per_client": 1,
    "open_requests": 8,
}


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,8,32, got {text!r}") from None


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",")) if text else ()
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected rates like 0.5,1,2, got {text!r}") from None


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The comparison's flags (``description``: the help text above them)."""
    ap = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    which = ap.add_argument_group("systems")
    which.add_argument("--only", choices=SYSTEMS, action="append", help="run only this system (repeatable)")
    for name in SYSTEMS:
        which.add_argument(f"--skip-{name}", action="store_true", help=f"do not run {name}")
    load = ap.add_argument_group("workload and load (the same for every system)")
    load.add_argument(
        "--quick", action="store_true", help="short smoke run: c=1,8, rates 0.5,1, few requests"
    )
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--input-len", type=length_range, default=(64, 128), metavar="MIN:MAX")
    load.add_argument("--output-len", type=int, default=64)
    load.add_argument(
        "--concurrency",
        type=_ints,
        metavar="C,C,...",
        help="closed-loop levels = HF batch sizes (default 1,8,32)",
    )
    load.add_argument(
        "--request-rate",
        type=_floats,
        metavar="R,R,...",
        help="open-loop Poisson rates, req/s; '' skips the sweep (default 0.25,0.5,1,2)",
    )
    load.add_argument("--min-requests", type=int, help="closed loop: requests per level at least (16)")
    load.add_argument("--rounds-per-client", type=int, help="closed loop: requests per client at least (2)")
    load.add_argument("--open-requests", type=int, help="open loop: requests per rate (24)")
    load.add_argument("--warmup-requests", type=int, default=2)
    load.add_argument("--request-timeout", type=float, default=300.0, metavar="S")
    runs = ap.add_argument_group("systems' settings")
    runs.add_argument("--vllm-venv", type=Path, default=DEFAULT_VENV, help="vLLM CPU venv, outside the repo")
    runs.add_argument("--reinstall-vllm", action="store_true", help="reinstall even if the venv imports fine")
    runs.add_argument("--vllm-threads-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    runs.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra vLLM server argument(s), shell-split, e.g. '--enforce-eager'",
    )
    runs.add_argument("--vllm-env", type=_key_value, action="append", default=[], metavar="KEY=VALUE")
    runs.add_argument(
        "--llama-server",
        type=Path,
        help="llama.cpp's llama-server binary, built outside the repo (adds llama.cpp to the systems; "
        "default for --only llamacpp: $KVPILOT_LLAMA_SERVER or llama-server on PATH)",
    )
    runs.add_argument("--llamacpp-arg", action="append", default=[], metavar="ARG")
    runs.add_argument("--kvpilot-model", default="smollm2-135m", help="kvpilot's model (llama.cpp: its GGUF)")
    runs.add_argument("--kvpilot-arg", action="append", default=[], metavar="ARG")
    runs.add_argument("--threads", type=int, default=2, help="HF torch threads")
    runs.add_argument("--hf-repeats", type=int, default=1, help="HF: runs per batch size (median kept)")
    runs.add_argument(
        "--omp-wait-policy",
        choices=("PASSIVE", "ACTIVE", "default"),
        default="PASSIVE",
        help="OMP_WAIT_POLICY for all three; 'default' leaves each its own (kvpilot: a short spin, "
        "GOMP_SPINCOUNT=20000, then sleep; vLLM and HF: libgomp's longer spinning default)",
    )
    limits = ap.add_argument_group("time limits and output")
    limits.add_argument(
        "--server-start-timeout",
        type=float,
        default=900.0,
        metavar="S",
        help="spawn to ready (vLLM's first start compiles for minutes)",
    )
    limits.add_argument("--bench-timeout", type=float, default=900.0, metavar="S", help="per bench serve run")
    limits.add_argument("--hf-timeout", type=float, default=900.0, metavar="S")
    limits.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS)
    limits.add_argument(
        "--work-dir",
        type=Path,
        help="logs and raw reports (default: a new folder under ~/.cache/kvpilot/compare-vllm)",
    )
    return ap


def selected_systems(args: argparse.Namespace) -> list[str]:
    """The systems to run, in run order; ValueError when the selection flags contradict each other."""
    skipped = {name for name in SYSTEMS if getattr(args, f"skip_{name}")}
    if args.only:
        clash = skipped & set(args.only)
        if clash:
            raise ValueError(
                f"--only {'/'.join(sorted(clash))} contradicts --skip-{'/--skip-'.join(sorted(clash))}"
            )
        return [name for name in SYSTEMS if name in args.only]
    chosen = [
        name
        for name in SYSTEMS
        if name not in skipped and (name not in OPT_IN or getattr(args, "llama_server", None) is not None)
    ]
    if not chosen:
        raise ValueError("every system is skipped: nothing to run")
    return chosen


def plan_from_args(args: argparse.Namespace) -> ComparePlan:
    """The validated plan; raises PlanError naming the flag."""
    sizes: dict[str, Any] = dict(QUICK) if args.quick else {}
    given = {
        "concurrencies": args.concurrency,
        "request_rates": args.request_rate,
        "min_requests": args.min_requests,
        "rounds_per_client": args.rounds_per_client,
        "open_requests": args.open_requests,
    }
    sizes = {**sizes, **{key: value for key, value in given.items() if value is not None}}
    plan = ComparePlan(
        seed=args.seed,
        input_len=args.input_len,
        output_len=args.output_len,
        warmup_requests=args.warmup_requests,
        request_timeout_s=args.request_timeout,
        **sizes,
    )
    plan.validate()
    for flag, value in (("--threads", args.threads), ("--hf-repeats", args.hf_repeats)):
        if value < 1:
            raise PlanError(f"{flag} must be >= 1 (got {value})")
    for flag, value in (
        ("--server-start-timeout", args.server_start_timeout),
        ("--bench-timeout", args.bench_timeout),
        ("--hf-timeout", args.hf_timeout),
    ):
        if not value > 0:
            raise PlanError(f"{flag} must be a positive number of seconds (got {value})")
    return plan
