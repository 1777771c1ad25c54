"""``kvpilot bench offline``: engine-only throughput — every request queued at once, no HTTP.

The workload is seeded random token ids (so input lengths are exact in tokens) with per-request output
lengths enforced by ``max_tokens`` + ``ignore_eos``; an optional shared prefix exercises prefix caching.
Reports output-token and total-token throughput of the whole batch and TTFT percentiles from the
engine's own per-request timestamps (arrival = when the request was queued).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvpilot.bench.config import length_range, length_range_error, output_path_error

if TYPE_CHECKING:
    from kvpilot.engine.llm import LLM

NAME = "offline"
HELP = "engine-only throughput: queue N requests at once on the offline engine and time the batch"
DESCRIPTION = __doc__


@dataclass(frozen=True)
class OfflineWorkload:
    """Seeded requests: ``prompts[i]`` token ids, ``output_lens[i]`` tokens to generate."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workload(
    num_requests: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
    vocab: tuple[int, int] = (100, 40000),
    shared_prefix_len: int = 0,
) -> OfflineWorkload:
    """Random prompts of lengths uniform in ``input_len`` (after an optional shared prefix) and output
    lengths uniform in ``output_len``; ids drawn from ``vocab`` (a range of ordinary tokens)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(*vocab) for _ in range(shared_prefix_len)]
    prompts = [
        prefix + [rng.randrange(*vocab) for _ in range(rng.randint(*input_len))] for _ in range(num_requests)
    ]
    outs = [rng.randint(*output_len) for _ in range(num_requests)]
    return OfflineWorkload(prompts, outs)


def token_id_range(vocab_size: int) -> tuple[int, int]:
    """Ids for random prompts: SmolLM2's ordinary-token range [100, 40000), clipped to a smaller vocabulary
    (whose first quarter, at most 100 ids, is skipped as the likeliest home of special tokens)."""
    return min(100, vocab_size // 4), min(40000, vocab_size)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for an empty list."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), -(-len(ordered) * q // 100)))
    return ordered[int(rank) - 1]


def run_kvpilot(llm: LLM, workload: OfflineWorkload) -> dict:
    """Time one batch of the workload on an ``LLM``; returns throughput and TTFT figures."""
    from kvpilot.engine import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params)
    wall = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != workload.num_output_tokens:
        raise RuntimeError(
            f"engine produced {produced} tokens, workload asked for {workload.num_output_tokens}"
        )
    ttfts = [o.metrics.ttft for o in outs if o.metrics and o.metrics.ttft is not None]
    return {
        "wall_s": wall,
        "output_tokens": produced,
        "output_tok_per_s": produced / wall,
        "total_tok_per_s": (produced + workload.num_prompt_tokens) / wall,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvpilot.engine.arg_utils import add_engine_args

    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument(
        "--input-len",
        type=length_range,
        default=(16, 256),
        metavar="MIN:MAX",
        help="prompt length range in tokens (default: 16:256)",
    )
    parser.add_argument(
        "--output-len",
        type=length_range,
        default=(16, 128),
        metavar="MIN:MAX",
        help="output length range in tokens (default: 16:128)",
    )
    parser.add_argument(
        "--shared-prefix-len", type=int, default=0, help="tokens of a prefix every prompt shares"
    )
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1, help="untimed warm-up batches (a small copy)")
    parser.add_argument("--output-json", type=Path, default=None)
    add_engine_args(parser)


def _checked(parser: argparse.ArgumentParser, flag: str, bounds: tuple[int, int]) -> tuple[int, int]:
    if error := length_range_error(flag, bounds):
        parser.error(error)
    return bounds


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from kvpilot.engine.arg_utils import config_from_namespace
    from kvpilot.engine.engine_core import LLMEngine, RequestError
    from kvpilot.engine.llm import LLM

    if args.num_requests < 1:
        parser.error("--num-requests must be >= 1")
    for flag, value in (("--shared-prefix-len", args.shared_prefix_len), ("--warmup", args.warmup)):
        if value < 0:
            parser.error(f"{flag} must be >= 0 (got {value})")
    if args.output_json and (error := output_path_error("--output-json", args.output_json, directory=False)):
        parser.error(error)
    input_len = _checked(parser, "--input-len", args.input_len)
    output_len = _checked(parser, "--output-len", args.output_len)
    config = config_from_namespace(parser, args)
    try:
        llm = LLM.from_engine(LLMEngine(config))
    except (ValueError, OSError) as err:
        print(f"kvpilot bench offline: {err}", file=sys.stderr)
        return 1
    vocab = token_id_range(llm.engine.arch.vocab_size)
    workload = make_workload(
        args.num_requests,
        input_len,
        output_len,
        args.workload_seed,
        vocab=vocab,
        shared_prefix_len=args.shared_prefix_len,
    )
    warm = make_workload(min(4, args.num_requests), (8, 32), (4, 8), args.workload_seed + 1, vocab=vocab)
    try:  # e.g. prompts longer than the model's context: known once it is loaded
        for _ in range(args.warmup):
            run_kvpilot(llm, warm)
        result = run_kvpilot(llm, workload)
    except RequestError as err:
        print(f"kvpilot bench offline: {err}", file=sys.stderr)
        return 1
    engine = llm.engine
    summary = {
        "model": engine.served_model_name,
        "dtype": str(engine.dtype),
        "requests": args.num_requests,
        "prompt_tokens": workload.num_prompt_tokens,
        **result,
        "steps": engine.num_steps,
        "preemptions": engine.scheduler.num_preemptions,
        "config": {k: v for k, v in asdict(config.scheduler).items()},
    }
    print(
        f"kvpilot bench offline: {args.num_requests} requests, {workload.num_prompt_tokens} prompt + "
        f"{result['output_tokens']} output tokens in {result['wall_s']:.2f} s\n"
        f"  output-token throughput {result['output_tok_per_s']:.1f} tok/s | total-token (prompt+output) "
        f"{result['total_tok_per_s']:.1f} tok/s\n"
        f"  TTFT p50 {result['ttft_p50_s'] * 1000:.0f} ms, p99 {result['ttft_p99_s'] * 1000:.0f} ms "
        f"(from queueing; all requests queued at t=0)\n"
        f"  prefix-cache hit tokens {result['cached_prompt_tokens']}, preemptions {summary['preemptions']}"
    )
    if args.output_json:
        try:
            args.output_json.parent.mkdir(parents=True, exist_ok=True)
            args.output_json.write_text(json.dumps(summary, indent=2))
        except OSError as err:
            print(f"kvpilot bench offline: cannot write --output-json: {err}", file=sys.stderr)
            return 1
    return 0
