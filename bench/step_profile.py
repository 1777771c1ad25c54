"""Where an engine step's time goes: host time per stage, model time, and on CUDA the GPU-busy fraction.

    python bench/step_profile.py                              # tiny-random, CPU, 128 decodes, sampling on
    python bench/step_profile.py --model PATH --device cuda --dtype bfloat16 --gpu-busy

Fills a batch of ``--batch`` requests (``--output-kind``: delta outputs by default, as the server asks for
them), runs their prompts, then times ``--steps`` decode-only steps (after ``--warmup`` untimed ones). Each
step's wall time is split by wrapping the engine's stages: ``schedule``, ``build_batch`` (flattened inputs and
block tables), ``forward`` (the model and logits; on CUDA followed by a synchronize so that GPU time is
charged here, not to the next stage's first sync), ``sample`` (sampler, appending tokens, stop checks,
detokenizing), ``deferred`` (with asynchronous output processing, the CUDA default or ``--async-output``: the
previous step's detokenizing and stop strings, run after the forward is launched; with ``--async-scheduling``,
appending the previous step's tokens) and ``outputs``. ``other`` is the rest of the tick. On CUDA the decode
steps replay captured graphs unless ``--enforce-eager`` (the eager baseline). With ``--gpu-busy`` (CUDA) the
timed steps also run under ``torch.profiler`` without the extra synchronize: the union of the GPU kernels'
intervals over the steps' wall time is the fraction of time the GPU was busy. With ``--ab-native-decode N``
(CPU, native kernels) N rounds then alternate decode steps with the one-call C decode step
(``model.native_decode``) on and off, in the same process; each side's best round median counts. With
``--ab-async-scheduling N`` N rounds alternate runs of 12 decode steps with asynchronous scheduling
(``async_scheduling``, docs/architecture.md#asynchronous-scheduling) on and off, in the same process, timed
with no synchronize between steps (what overlaps is the point); each side's best round counts, and with
``--gpu-busy`` the GPU-busy fraction is taken again with it on. ``--cpu-time`` times steps in the thread's CPU
time (with ``--threads 1``: robust on a shared host). Prints a table and, with ``--output-json``, writes the
figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable

import torch

from kvpilot.engine import LLM, SamplingParams

STAGES = ("schedule", "build_batch", "forward", "deferred", "sample", "outputs")


def busy_fraction(intervals: Iterable[tuple[float, float]], wall: float) -> float:
    """Length of the union of ``(start, end)`` intervals over ``wall`` (same unit)."""
    covered, end_so_far = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= end_so_far:
            continue
        covered += end - max(start, end_so_far)
        end_so_far = end
    return covered / wall if wall > 0 else 0.0


class StageTimer:
    """Wraps engine methods so each call's wall time accumulates under a stage name for the current step."""

    def __init__(self, sync: Callable[[], None], clock: Callable[[], float] = time.perf_counter) -> None:
        self.sync = sync
        self.clock = clock
        self.current: dict[str, float] = dict.fromkeys(STAGES, 0.0)

    def wrap(self, owner: object, method: str, stage: str, sync_after: bool = False) -> None:
        inner = getattr(owner, method)

        def timed(*args, **kwargs):
            start = self.clock()
            result = inner(*args, **kwargs)
            if sync_after:
                self.sync()
            self.current[stage] += self.clock() - start
            return result

        setattr(owner, method, timed)

    def take(self) -> dict[str, float]:
        taken, self.current = self.current, dict.fromkeys(STAGES, 0.0)
        return taken


def sampling_params(sampling: bool, max_tokens: int, output_kind: str = "delta") -> SamplingParams:
    """The requests' parameters; ``delta`` outputs by default, as the server streams them."""
    common = {"max_tokens": max_tokens, "ignore_eos": True, "output_kind": output_kind}
    if not sampling:
        return SamplingParams(temperature=0.0, **common)
    return SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=None, **common)


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    clock = time.thread_time if args.cpu_time else time.perf_counter
    decode_steps = args.warmup + args.steps + 2 + (args.ab_native_decode + args.ab_async_scheduling) * 2 * 15
    if args.gpu_busy and args.ab_async_scheduling:
        decode_steps += args.steps
    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(args.batch, 2048),
        block_size=16,
        num_kv_blocks=args.batch * (-(-(args.prompt_len + decode_steps) // 16)) + 8,
        enable_prefix_caching=False,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
    )
    if args.async_output:  # on by default on CUDA only
        llm.engine.output_processor.appender.defer_detokenize = True
    engine = llm.engine
    cuda = engine.device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(engine.device)) if cuda else (lambda: None)
    rng = random.Random(args.seed)
    vocab = engine.arch.vocab_size
    params = sampling_params(args.sampling, decode_steps, args.output_kind)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [rng.randrange(3, vocab) for _ in range(args.prompt_len)], params)
    while any(r.num_output_tokens == 0 for r in engine.sequences.values()):
        engine.step()  # prompts (chunked by the token budget) until every sequence decodes
    for _ in range(args.warmup):
        engine.step()
    sync()

    def timed_steps(timer: StageTimer | None, count: int) -> tuple[list[float], list[dict[str, float]]]:
        walls, stages = [], []
        for _ in range(count):
            start = clock()
            engine.step()
            sync()
            walls.append(clock() - start)
            if timer is not None:
                stages.append(timer.take())
        return walls, stages

    timer = StageTimer(sync, clock)
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.runner, "build_batch", "build_batch")
    timer.wrap(engine.runner, "execute", "forward", sync_after=cuda)
    timer.wrap(engine.output_processor, "sample", "sample")
    # asynchronous output processing (on CUDA): the previous step's text, while this step's forward runs
    timer.wrap(engine.output_processor.appender, "flush_deferred", "deferred")
    # asynchronous scheduling: the previous step's tokens appended, while this step's forward runs
    timer.wrap(engine.output_processor, "resolve_in_flight", "deferred")
    timer.wrap(engine.registry, "drain_outputs", "outputs")
    walls, stages = timed_steps(timer, args.steps)
    step_ms = statistics.median(walls) * 1e3
    stage_ms = {s: statistics.median(st[s] for st in stages) * 1e3 for s in STAGES}
    stage_ms["other"] = max(0.0, step_ms - sum(stage_ms.values()))
    result = {
        "model": args.model,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "sampling": args.sampling,
        "steps": args.steps,
        "step_ms_p50": step_ms,
        "step_ms_p90": sorted(walls)[int(0.9 * (len(walls) - 1))] * 1e3,
        "stage_ms_p50": stage_ms,
        "output_tokens_per_second": args.batch / statistics.median(walls),
    }
    graphs = engine.runner.decode_graphs
    # on CUDA: whether the timed decode steps replayed captured graphs (docs/architecture.md#captured-decode)
    result["decode_graphs"] = bool(graphs and graphs.captured and graphs.replays)
    if graphs is not None and graphs.captured:
        result["graph_memory_mib"] = graphs.memory_bytes / 2**20
    if args.gpu_busy and cuda:
        result["gpu_busy_fraction"] = profile_gpu_busy(engine, sync, args.steps)
    if args.ab_native_decode:
        result["native_decode_ab_ms"] = native_decode_ab(engine, args.ab_native_decode, timed_steps)
    if args.ab_async_scheduling:
        result["async_scheduling_ab_ms"] = async_scheduling_ab(engine, sync, args.ab_async_scheduling)
        if args.gpu_busy and cuda:
            engine.output_processor.async_scheduling = True
            result["gpu_busy_fraction_async"] = profile_gpu_busy(engine, sync, args.steps)
    return result


def async_scheduling_ab(engine, sync: Callable[[], None], rounds: int) -> dict[str, float]:
    """Best round's mean decode step (ms, 12 steps timed together: nothing synchronizes between them) with
    asynchronous scheduling on and off, rounds alternating. Switching is safe between any two steps: a
    token in flight is appended by the next step whatever the setting."""
    processor = engine.output_processor
    before = processor.async_scheduling
    unwrap_execute(engine)
    best = {"on": float("inf"), "off": float("inf")}
    for _ in range(rounds):
        for side in best:
            processor.async_scheduling = side == "on"
            for _ in range(3):  # settle
                engine.step()
            sync()
            start = time.perf_counter()
            for _ in range(12):
                engine.step()
            sync()
            best[side] = min(best[side], (time.perf_counter() - start) / 12 * 1e3)
    processor.async_scheduling = before
    return best


def native_decode_ab(engine, rounds: int, timed_steps) -> dict[str, float]:
    """Best round median step (ms) with the one-call C decode step on and off, rounds alternating."""
    model = engine.model
    fused = model.decode_step
    if not fused:
        raise SystemExit("the C decode step does not run this model here (see the engine log)")
    best = {"on": float("inf"), "off": float("inf")}
    for _ in range(rounds):
        for side in best:
            model.decode_step = fused if side == "on" else False
            timed_steps(None, 3)  # settle
            walls, _ = timed_steps(None, 12)
            best[side] = min(best[side], statistics.median(walls) * 1e3)
    model.decode_step = fused
    return best


def unwrap_execute(engine) -> None:
    """The forward without the stage timer's synchronize after it."""
    engine.runner.execute = type(engine.runner).execute.__get__(engine.runner)


def profile_gpu_busy(engine, sync: Callable[[], None], steps: int) -> float:
    """Fraction of the steps' wall time with a GPU kernel running (no synchronize inside the steps)."""
    unwrap_execute(engine)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        wall_us = (time.perf_counter() - start) * 1e6
    kernels = [
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    return busy_fraction(kernels, wall_us)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--threads", type=int, default=0, help="torch/OpenMP threads (0: the default)")
    parser.add_argument("--cpu-time", action="store_true", help="time steps in the thread's CPU time")
    parser.add_argument("--ab-native-decode", type=int, default=0, metavar="ROUNDS")
    parser.add_argument(
        "--output-kind",
        choices=("cumulative", "delta", "final_only"),
        default="delta",
        help="what each step's outputs hold (default delta: what the server streams)",
    )
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sampling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="temperature 0.8, top-p 0.95, top-k 50 (default); --no-sampling: greedy",
    )
    parser.add_argument(
        "--gpu-busy", action="store_true", help="on CUDA: GPU-busy fraction from torch.profiler"
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="on CUDA: no captured decode graphs (the baseline)"
    )
    parser.add_argument(
        "--async-output",
        action="store_true",
        help="asynchronous output processing on any device (the CUDA default): the deferred stage is the "
        "host time that runs while the next step's forward is on the device",
    )
    parser.add_argument(
        "--async-scheduling", action="store_true", help="asynchronous scheduling (the engine's flag)"
    )
    parser.add_argument("--ab-async-scheduling", type=int, default=0, metavar="ROUNDS")
    parser.add_argument("--output-json")
    args = parser.parse_args(argv)
    if min(args.batch, args.prompt_len, args.steps) < 1 or args.warmup < 0:
        parser.error("--batch, --prompt-len and --steps must be >= 1, --warmup >= 0")
    result = run(args)
    print(
        f"{result['model']} on {result['device']} ({result['dtype']}), {result['batch']} decodes, "
        f"sampling {'on' if result['sampling'] else 'off'}, "
        f"decode graphs {'on' if result['decode_graphs'] else 'off'}"
        + (f" ({result['graph_memory_mib']:.1f} MiB)" if "graph_memory_mib" in result else "")
        + ": "
        f"step p50 {result['step_ms_p50']:.2f} ms, "
        f"p90 {result['step_ms_p90']:.2f} ms, {result['output_tokens_per_second']:.0f} output tok/s"
    )
    for stage, ms in result["stage_ms_p50"].items():
        print(f"  {stage:<12} {ms:8.3f} ms  {ms / result['step_ms_p50']:6.1%}")
    ab = result.get("native_decode_ab_ms")
    if ab:
        print(
            f"  one-call C decode step: on {ab['on']:.2f} ms, off (layer by layer) {ab['off']:.2f} ms, "
            f"x{ab['off'] / ab['on']:.2f}"
        )
    if "gpu_busy_fraction" in result:
        print(f"  GPU busy {result['gpu_busy_fraction']:.1%} of the steps' wall time")
    ab = result.get("async_scheduling_ab_ms")
    if ab:
        print(
            f"  asynchronous scheduling: on {ab['on']:.2f} ms, off {ab['off']:.2f} ms a step (steps back to "
            f"back), x{ab['off'] / ab['on']:.2f}"
        )
    if "gpu_busy_fraction_async" in result:
        print(f"  GPU busy with asynchronous scheduling {result['gpu_busy_fraction_async']:.1%}")
    if args.output_json:
        with open(args.output_json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
