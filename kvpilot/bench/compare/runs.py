"""Measuring one system: a server under ``kvpilot bench serve`` (closed-loop levels, then the open-loop
sweep), or HF ``generate`` in a child process. Each step has a timeout; a failure ends that system's
measurement with a :class:`RunError` whose message says what failed, and the caller moves on.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from kvpilot.bench.compare.plan import ComparePlan
from kvpilot.bench.compare.results import cold_start_figures, point_figures, saturation_figures
from kvpilot.bench.compare.servers import ManagedServer, ServerError, ServerSpec, log_tail

HF_FLOOR_MODULE = "kvpilot.bench.compare.hf_floor"  # run as `python -m` in the work dir
BENCH_ERROR_LINES = 12


class RunError(RuntimeError):
    """One system's measurement failed; the message names the step and the log to read."""


@dataclass(frozen=True)
class Timeouts:
    server_start_s: float  # spawn to ready
    bench_run_s: float  # one `bench serve` run (one closed-loop level, or the whole open-loop sweep)
    hf_s: float  # the whole HF floor


def bench_serve(args: list[str], log_path: Path, report_path: Path, timeout_s: float) -> dict:
    """Run ``kvpilot bench serve ARGS`` (which writes ``report_path``) and return the parsed report."""
    argv = [sys.executable, "-m", "kvpilot.cli", "bench", "serve", *args]
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            # cwd: `python -m` puts it on sys.path, and at the repo root operator/ shadows the stdlib.
            result = subprocess.run(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                stdin=subprocess.DEVNULL,
                cwd=log_path.parent,
            )
        except subprocess.TimeoutExpired:
            raise RunError(
                f"`bench serve` ran past {timeout_s:g} s (raise --bench-timeout); log: {log_path}"
            ) from None
    if result.returncode != 0:
        raise RunError(
            f"`bench serve` exited with code {result.returncode}; last lines of {log_path}:\n"
            f"{log_tail(log_path, BENCH_ERROR_LINES)}"
        )
    try:
        return json.loads(report_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RunError(f"`bench serve` wrote no readable report at {report_path}: {exc}") from None


def measure_server(
    spec: ServerSpec,
    plan: ComparePlan,
    work_dir: Path,
    plot_dir: Path | None,
    timeouts: Timeouts,
    say: Callable[[str], None] = print,
) -> dict:
    """Start the server, wait until ready, run every closed-loop level and the open-loop sweep, stop it.

    Returns the system's part of the summary: ``cold_start``, ``closed`` (level -> figures), ``open``
    (rate -> figures), ``saturation``. The server is stopped whatever happens.
    """
    system_dir = work_dir / spec.name
    system_dir.mkdir(parents=True, exist_ok=True)
    spec = replace(spec, start_timeout_s=timeouts.server_start_s)
    with ManagedServer(spec, system_dir / "server.log") as server:
        say(f"[{spec.name}] starting: {' '.join(spec.argv)}")
        try:
            ready_s = server.wait_ready()
        except ServerError as exc:
            raise RunError(str(exc)) from None
        say(f"[{spec.name}] ready after {ready_s:.1f} s")
        closed, first_report = {}, None
        for level in plan.levels:
            started = time.perf_counter()
            report_path = system_dir / f"closed_c{level}.json"
            args = [*plan.closed_loop_args(spec.base_url, level, report_path), *spec.bench_args]
            report = bench_serve(args, system_dir / f"closed_c{level}.log", report_path, timeouts.bench_run_s)
            first_report = first_report or report
            figures = point_figures(report["points"][0])
            closed[str(level)] = figures
            say(
                f"[{spec.name}] closed loop c={level}: {figures['output_tps']:.1f} output tok/s, "
                f"{figures['requests_ok']}/{figures['requests_total']} ok "
                f"({time.perf_counter() - started:.0f} s)"
            )
        open_points, saturation = {}, None
        if plan.rates:
            report_path = system_dir / "open_sweep.json"
            open_plots = None if plot_dir is None else plot_dir / spec.name
            args = [*plan.open_loop_args(spec.base_url, report_path, open_plots), *spec.bench_args]
            report = bench_serve(args, system_dir / "open_sweep.log", report_path, timeouts.bench_run_s)
            for point in report["points"]:
                figures = point_figures(point)
                open_points[f"{figures['load']:g}"] = figures
                say(
                    f"[{spec.name}] open loop {figures['load']:g} req/s: achieved "
                    f"{figures['request_rps']:.2f} req/s, TTFT p50 {_ms(figures['ttft_s']['p50'])}"
                )
            saturation = saturation_figures(report)
    say(f"[{spec.name}] stopped")
    if first_report is None:  # ComparePlan.validate requires a closed-loop level
        raise RunError(f"[{spec.name}] no closed-loop level ran, so there is no cold start to report")
    return {
        "cold_start": cold_start_figures(first_report, ready_s),
        "closed": closed,
        "open": open_points,
        "saturation": saturation,
    }


def measure_hf(
    plan: ComparePlan,
    model_dir: Path,
    threads: int,
    repeats: int,
    work_dir: Path,
    env: dict[str, str],
    timeout_s: float,
    say: Callable[[str], None] = print,
) -> dict:
    """HF ``generate`` at every batch size in a child process; returns its JSON result."""
    hf_dir = work_dir / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    prompts_path, result_path, log_path = hf_dir / "prompts.json", hf_dir / "hf.json", hf_dir / "hf.log"
    prompts_path.write_text(json.dumps({str(b): plan.hf_prompts(b) for b in plan.levels}))
    argv = [
        sys.executable,
        "-m",
        HF_FLOOR_MODULE,
        "--model-dir",
        str(model_dir),
        "--prompts",
        str(prompts_path),
        "--output-len",
        str(plan.output_len),
        "--threads",
        str(threads),
        "--repeats",
        str(repeats),
        "--output-json",
        str(result_path),
    ]
    say(f"[hf] generate at batch {', '.join(map(str, plan.levels))} ({threads} threads)")
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            result = subprocess.run(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                env=env,
                stdin=subprocess.DEVNULL,
                cwd=hf_dir,
            )
        except subprocess.TimeoutExpired:
            raise RunError(
                f"HF generate ran past {timeout_s:g} s (raise --hf-timeout); log: {log_path}"
            ) from None
    if result.returncode != 0:
        raise RunError(
            f"HF generate exited with code {result.returncode}; last lines of {log_path}:\n"
            f"{log_tail(log_path, BENCH_ERROR_LINES)}"
        )
    figures = json.loads(result_path.read_text(encoding="utf-8"))
    for batch in sorted(figures["batches"].values(), key=lambda b: b["batch"]):
        say(
            f"[hf] batch {batch['batch']}: {batch['output_tok_per_s']:.1f} output tok/s "
            f"({batch['wall_s']:.1f} s)"
        )
    return figures


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.0f} ms"
