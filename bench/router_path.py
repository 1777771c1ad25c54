"""The cache_aware router's per-request work, stage by stage, in-process: body parse, profile (chat render and
encode), replica choice — on a core that an engine's matmuls share, as in router_bench's shared placement.

It runs router_bench's workload (12 tenants, 600-word system prompts, 32-96-word questions) through the
router's own functions against three synthetic replicas whose caches hold what was sent to them, so the
first request of each tenant is a cold decision and the rest are affinity ones. ``--hog`` runs a numpy matmul
loop under SCHED_IDLE on the same CPU (an engine's place in router_bench): it takes the core whenever this
process sleeps between requests, as an engine does, and so evicts the caches the next request needs.
Figures are milliseconds per request, by decision reason.

    .venv/bin/python bench/router_path.py --hog
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from router_bench import placement  # a sibling script: the hog is placed as router_bench places engines

from kvpilot.bench.config import WorkloadConfig
from kvpilot.bench.workloads import Workload
from kvpilot.engine.kv.block_hash import root_hash
from kvpilot.router.config import ScoringWeights
from kvpilot.router.engine_load import EngineLoad
from kvpilot.router.json_body import parse_json
from kvpilot.router.picker import ReplicaPicker
from kvpilot.router.replica import Replica
from kvpilot.router.request_profile import CHAT_COMPLETIONS
from kvpilot.router.server import load_profiler

STAGES = ("parse", "profile", "pick", "total")
HOG = "import numpy as np\na = np.random.rand(1200, 1200).astype(np.float32)\nwhile True:\n    a @ a\n"


def replicas(count: int, root: bytes) -> list[Replica]:
    made = []
    for i in range(count):
        replica = Replica(f"http://10.0.0.{i + 1}:8000")
        replica.accept_load(
            EngineLoad(
                ready=True,
                phase="ready",
                epoch="e",
                waiting=0,
                running=1,
                queued_prefill_tokens=0,
                running_decode_tokens=1,
                kv_blocks_total=10_000,
                kv_blocks_free=9_000,
                kv_blocks_reserved=0,
                block_size=16,
                max_num_seqs=64,
                prefill_tokens_per_second=5000.0,
                decode_step_seconds=0.02,
            ),
            0.0,
        )
        replica.index.root, replica.index.block_size, replica.index.synced, replica.index.epoch = (
            root,
            16,
            True,
            "e",
        )
        made.append(replica)
    return made


def start_hog(cpu: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", HOG],
        preexec_fn=placement(0, {cpu}, idle=True),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def measure(model: str, requests: int, gap_s: float, seed: int) -> dict[str, dict[str, list[float]]]:
    """Milliseconds per stage, by decision reason."""
    profiler = load_profiler(model)
    root = root_hash(model)
    fleet = replicas(3, root)
    picker = ReplicaPicker("cache_aware", ScoringWeights(), prefill_rate_prior=4000.0)
    workload = WorkloadConfig(
        kind="shared-prefix",
        input_len_range=(32, 96),
        output_len_range=(16, 32),
        num_tenants=12,
        system_prompt_len=600,
    )
    stream = Workload(workload, seed).stream(np.random.default_rng(seed))
    times: dict[str, dict[str, list[float]]] = {}
    for _ in range(requests):
        sample = next(stream)
        raw = json.dumps(
            {
                "model": model,
                "max_tokens": sample.max_tokens,
                "stream": True,
                "messages": [
                    {"role": "system", "content": sample.system_prompt},
                    {"role": "user", "content": sample.prompt},
                ],
            }
        ).encode()
        time.sleep(gap_s)
        start = time.perf_counter()
        body = parse_json(raw)
        parsed = time.perf_counter()
        profile = profiler.profile(CHAT_COMPLETIONS, body, sample.tenant)  # type: ignore[arg-type]
        profiled = time.perf_counter()
        replica, decision = picker.pick(fleet, profile)
        picked = time.perf_counter()
        replica.index.hashes.update(replica.chains(profile)[0].all_hashes())  # the engine caches the prompt
        by_stage = times.setdefault(decision.reason, {stage: [] for stage in STAGES})
        for stage, seconds in zip(
            STAGES, (parsed - start, profiled - parsed, picked - profiled, picked - start), strict=True
        ):
            by_stage[stage].append(seconds * 1000)
    return times


def report(times: dict[str, dict[str, list[float]]]) -> list[str]:
    lines = []
    for reason in sorted(times):
        cells = [
            f"{stage} p50 {statistics.median(v):.3f} max {max(v):.3f}" for stage, v in times[reason].items()
        ]
        lines.append(f"{reason} ({len(times[reason]['total'])}): " + ", ".join(cells))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--gap-ms", type=float, default=20.0, help="sleep before each request")
    parser.add_argument("--cpu", type=int, default=os.cpu_count() - 1, help="the CPU this process runs on")
    parser.add_argument("--hog", action="store_true", help="share the CPU with a SCHED_IDLE matmul loop")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    hog = start_hog(args.cpu) if args.hog else None
    try:
        times = measure(args.model, args.requests, args.gap_ms / 1000, args.seed)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    print("\n".join(report(times)))


if __name__ == "__main__":
    main()
