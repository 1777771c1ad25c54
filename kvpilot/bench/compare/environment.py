"""The comparison report's first section: the machine, its load and free compute as each system started
(a run is Noisy when others loaded it), the workload, and how each system was run."""

from __future__ import annotations

from kvpilot.bench.compare.probe import QUIET_GEMM_GFLOPS
from kvpilot.bench.compare.results import STATUS_OK, SYSTEM_TITLES

BUSY_LOAD_PER_CORE = 0.25  # 1-minute load average per core above which the run is flagged as noisy


def is_busy(summary: dict) -> bool:
    """Busy when others loaded the machine: the load before the run, or, as each system started, less fp32
    GEMM rate than a quiet machine gives (its load average then still carries the previous system's own
    threads for a minute or two, so it is read only where no probe ran; the load after the run carries the
    last system's)."""
    env = summary["environment"]
    cores = env.get("cpu_count") or 1
    if env.get("load_before", [0.0])[0] / cores > BUSY_LOAD_PER_CORE:
        return True
    for system in summary["systems"].values():
        probe = system.get("gemm_gflops_at_start")
        if probe is not None:
            if probe < QUIET_GEMM_GFLOPS:
                return True
        elif system.get("load_at_start") and system["load_at_start"][0] / cores > BUSY_LOAD_PER_CORE:
            return True
    return False


def environment_lines(summary: dict) -> list[str]:
    env, plan = summary["environment"], summary["plan"]
    loads = " → ".join(
        ", ".join(f"{x:.2f}" for x in env[key]) for key in ("load_before", "load_after") if env.get(key)
    )
    starts = ", ".join(
        f"{SYSTEM_TITLES[name]} {system['load_at_start'][0]:.2f}"
        for name, system in summary["systems"].items()
        if system.get("load_at_start")
    )
    lines = [
        f"Run {env['started_at']} on {env['cpu_model']}, {env['cpu_count']} cores; "
        f"load average (1, 5, 15 min) before → after: {loads}"
        + (f"; 1-min load average as each system started: {starts}" if starts else "")
        + ". While a system runs it adds about its own thread count to the load average.",
    ]
    probes = ", ".join(
        f"{SYSTEM_TITLES[name]} {system['gemm_gflops_at_start']:.0f}"
        for name, system in summary["systems"].items()
        if system.get("gemm_gflops_at_start")
    )
    if probes:
        lines[0] += (
            f" fp32 GEMM GFLOP/s available (1 s probe, {env.get('probe_threads', 2)} threads) as "
            f"each system started: {probes}; a quiet machine of this kind gives ~{QUIET_GEMM_GFLOPS:.0f}+."
        )
    if is_busy(summary):
        lines += [
            "",
            "> **Noisy:** the machine was shared and busy during this run (load average above "
            f"{BUSY_LOAD_PER_CORE:g} per core before it, or less than {QUIET_GEMM_GFLOPS:.0f} fp32 GEMM "
            "GFLOP/s free as a system started). Treat every figure as indicative only; the final "
            "figures must be re-taken on a quiet machine.",
        ]
    lines += [
        "",
        f"Workload (the same for every system): seed {plan['seed']}, prompts of "
        f"{plan['input_len'][0]}–{plan['input_len'][1]} tokens (random words; one word is one token for this "
        f"tokenizer), exactly {plan['output_len']} output tokens (greedy, `ignore_eos`), streaming "
        f"`/v1/completions`; {plan['warmup_requests']} warm-up requests per `bench serve` run, excluded. "
        f"Model: SmolLM2-135M-Instruct, fp32, weights from `{env['model_dir']}` for all three.",
    ]
    if summary["systems"].get("llamacpp", {}).get("status") == STATUS_OK:
        lines[-1] += (
            " llama.cpp and kvpilot (`quantization=auto`) both compute on the GGUF's own Q4_1/Q8_0 blocks "
            "instead (the file that directory was converted from)."
        )
    for name in SYSTEM_TITLES:
        system = summary["systems"].get(name, {})
        if system.get("status") == STATUS_OK and system.get("describe"):
            lines.append(f"- {SYSTEM_TITLES[name]}: {system['describe']}")
    return lines
