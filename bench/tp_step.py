"""Tensor parallelism's decode step: tp=1 against tp=N in one run, and its collectives counted
(docs/architecture.md#tensor-parallelism).

    python bench/tp_step.py                                   # SmolLM2-shaped random model, tp 1 vs 2, CPU
    python bench/tp_step.py --tp 2 --batch 8 --steps 32 --output-json out.json

The model is a seeded random Llama with SmolLM2-135M's widths (hidden 576, 30 layers, MLP 1536) but 8
query / 4 KV heads of 72 dims, so it splits two ways (SmolLM2's 9 heads do not), and a 688-token
vocabulary (the tiny tokenizer's). For each tp the engine fills ``--batch`` requests, runs their prompts,
then times ``--steps`` decode-only steps after ``--warmup`` untimed ones; the ratio of the p50 step times
comes from the same run. On rank 0 every all-reduce and logits gather is counted (calls and bytes) over
the timed steps, and checked against the per-step formula the GPU table uses: ``2 × layers + 1``
all-reduces of ``tokens × hidden`` activations and one gather of ``rows × ceil(V / tp)`` float32 logits
per rank. ``--gpu-table`` prints that formula for Llama-3-8B and -70B in bf16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.distributed.groups import TensorParallelGroup
from kvpilot.engine.model.tiny import write_tiny_llama

#: SmolLM2-135M's widths with heads that split two (and four) ways
SHAPE = {
    "vocab_size": 688,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 72,
    "max_position_embeddings": 2048,
}


@dataclass(frozen=True)
class Collectives:
    """A decode step's collectives under tensor parallelism, per the design."""

    all_reduces: int
    all_reduce_bytes: int  # each all-reduce's buffer
    gather_bytes_per_rank: int  # each rank's logits shard sent to rank 0


def step_collectives(
    layers: int, hidden: int, vocab: int, tp: int, tokens: int, rows: int, act_bytes: int
) -> Collectives:
    """One step of ``tokens`` flat tokens and ``rows`` logits rows: two all-reduces per decoder layer
    (after ``o_proj`` and ``down_proj``) and one after the embedding, then the gather of the logits."""
    shard = -(-vocab // tp)
    return Collectives(2 * layers + 1, tokens * hidden * act_bytes, rows * shard * 4)


def ring_bytes_per_rank(buffer: int, tp: int) -> float:
    """What a ring all-reduce sends per rank: reduce-scatter plus all-gather, ``2(tp-1)/tp`` of it."""
    return 2 * (tp - 1) / tp * buffer


class CountingGroup:
    """Counts rank 0's collectives (calls, bytes) by wrapping the group's methods."""

    def __init__(self) -> None:
        self.all_reduces = self.all_reduce_bytes = self.gathers = self.gather_bytes = 0
        self._reduce, self._gather = TensorParallelGroup.all_reduce, TensorParallelGroup.gather_columns
        counter = self

        def all_reduce(group, tensor):
            counter.all_reduces += 1
            counter.all_reduce_bytes += tensor.numel() * tensor.element_size()
            return counter._reduce(group, tensor)

        def gather_columns(group, tensor):
            counter.gathers += 1
            counter.gather_bytes += tensor.numel() * tensor.element_size()
            return counter._gather(group, tensor)

        TensorParallelGroup.all_reduce = all_reduce  # type: ignore[method-assign]
        TensorParallelGroup.gather_columns = gather_columns  # type: ignore[method-assign]

    def reset(self) -> None:
        self.all_reduces = self.all_reduce_bytes = self.gathers = self.gather_bytes = 0


def time_decode(model: str, tp: int, args: argparse.Namespace, counter: CountingGroup) -> dict:
    llm = LLM(model, device="cpu", tensor_parallel_size=tp, num_kv_blocks=args.batch * 8 + 8, seed=0)
    engine = llm.engine
    try:
        params = SamplingParams(
            temperature=0.0, max_tokens=args.warmup + args.steps + 1, ignore_eos=True, detokenize=False
        )
        for i in range(args.batch):
            engine.add_request(f"r{i}", [(7 * i + 3 * j) % 600 + 3 for j in range(args.prompt_len)], params)
        while any(r.num_output_tokens == 0 for r in engine.sequences.values()):
            engine.step()  # the prompts, until every request decodes
        for _ in range(args.warmup):
            engine.step()
        counter.reset()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        counted = {
            "all_reduces": counter.all_reduces,
            "all_reduce_bytes": counter.all_reduce_bytes,
            "gathers": counter.gathers,
            "gather_bytes": counter.gather_bytes,
        }
    finally:
        engine.shutdown()
    return {
        "tp": tp,
        "step_ms_p50": statistics.median(times) * 1e3,
        "step_ms_min": min(times) * 1e3,
        **counted,
    }


def gpu_table() -> list[str]:
    lines = ["model            tp  all-reduces/step  bytes/all-reduce/token  ring bytes sent/rank/token/step"]
    for name, layers, hidden in (("Llama-3-8B", 32, 4096), ("Llama-3-70B", 80, 8192)):
        for tp in (2, 4, 8):
            c = step_collectives(layers, hidden, 128256, tp, 1, 1, 2)
            ring = ring_bytes_per_rank(c.all_reduce_bytes, tp) * c.all_reduces
            counts = f"{c.all_reduces:>16}  {c.all_reduce_bytes:>22}"
            lines.append(f"{name:<16} {tp:>2}  {counts}  {ring / 2**20:>10.2f} MiB")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="the tensor-parallel size compared with 1")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"], help="decoder layers")
    parser.add_argument("--output-json", type=Path)
    parser.add_argument("--gpu-table", action="store_true", help="print the collectives of Llama-3 on GPUs")
    args = parser.parse_args(argv)
    if min(args.tp, args.batch, args.prompt_len, args.steps, args.layers) < 1 or args.tp < 2:
        parser.error("--tp must be >= 2; --batch, --prompt-len, --steps and --layers >= 1")
    if args.gpu_table:
        print("\n".join(gpu_table()))
    shape = {**SHAPE, "num_hidden_layers": args.layers}
    counter = CountingGroup()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_llama(Path(tmp) / "model", seed=0, **shape))
        results = [time_decode(model, tp, args, counter) for tp in (1, args.tp)]
    base, split = results
    expected = step_collectives(
        args.layers, shape["hidden_size"], shape["vocab_size"], args.tp, args.batch, args.batch, 4
    )
    assert split["all_reduces"] == expected.all_reduces * args.steps, split
    assert split["all_reduce_bytes"] == expected.all_reduce_bytes * expected.all_reduces * args.steps, split
    assert split["gather_bytes"] == expected.gather_bytes_per_rank * args.steps, split
    report = {
        "shape": shape,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "steps": args.steps,
        "results": results,
        "ratio_tp_over_tp1": split["step_ms_p50"] / base["step_ms_p50"],
        "per_step": {
            "all_reduces": expected.all_reduces,
            "bytes_per_all_reduce": expected.all_reduce_bytes,
            "gather_bytes_per_rank": expected.gather_bytes_per_rank,
        },
    }
    for r in results:
        print(f"tp={r['tp']}: decode step p50 {r['step_ms_p50']:.1f} ms (min {r['step_ms_min']:.1f} ms)")
    print(
        f"tp={args.tp} / tp=1: x{report['ratio_tp_over_tp1']:.2f}; per step {expected.all_reduces} "
        f"all-reduces of {expected.all_reduce_bytes} B and a {expected.gather_bytes_per_rank} B logits "
        "gather per rank"
    )
    if args.output_json:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
