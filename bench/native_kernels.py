"""Benchmark the native C kernels (kvpilot.engine.native) against the PyTorch ops they replace, on SmolLM2's
shapes (30 layers, hidden 576, 9/3 heads of 64, MLP 1536, vocab 49152), fp32, in one process.

    python bench/native_kernels.py            # decode steps at batch 1–128 and a 2048-token prefill
    python bench/native_kernels.py --quick    # fewer repetitions (what CI runs)

Each row times one op for all 30 layers (different weights/caches per layer, so the sweep streams from
memory as a real step does) and prints ``ratio`` = baseline time / native time (> 1: native is faster):
- ``linear``: the four projections of 30 layers, the native panel GEMM vs the oneDNN-packed weights
  (the engine's CPU default; the engine uses the native one up to ``NATIVE_MAX_ROWS`` rows) and vs
  ``F.linear``;
- ``decode_attention``: paged decode over 30 layers' caches, native vs the torch backend's gather + SDPA;
- ``prefill_attention``: causal attention of a step's new tokens (after a cached prefix or none), native
  vs the torch backend's SDPA per sequence (gathering the prefix from the cache);
- ``silu_mul``, ``add_rms_norm``: vs the PyTorch expressions of ``kvpilot.engine.native.ops``.
Times are the best of ``--repeat`` rounds in which native and baselines alternate (wall clock,
``--threads`` threads).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.engine.attention.torch_backend import TorchAttentionBackend
from kvpilot.engine.model.cpu_linear import onednn_available
from kvpilot.engine.model.registry import default_cache_dir
from kvpilot.engine.native.ops import NativeOps, load_native_ops
from kvpilot.engine.native.reference import reference_add_rms_norm, reference_silu_mul

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 30, 576, 9, 3, 64, 1536
#: (in, out) of qkv, o, gate_up and down
PROJECTIONS = (
    (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM),
    (HEADS * HEAD_DIM, HIDDEN),
    (HIDDEN, 2 * INTERMEDIATE),
    (INTERMEDIATE, HIDDEN),
)


def best_ms(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Best time of each function over ``repeat`` rounds that run them in turn: this host's speed drifts
    over minutes, and alternating keeps every variant on the same stretch of it."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: seconds * 1e3 for name, seconds in best.items()}


def bench_linear(ops: NativeOps, rows: int, repeat: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(rows)
    weights = [
        [torch.randn(n_out, n_in, generator=gen) / n_in**0.5 for n_in, n_out in PROJECTIONS]
        for _ in range(LAYERS)
    ]
    inputs = [torch.randn(rows, n_in, generator=gen) for n_in, _ in PROJECTIONS]
    panels = [[(ops.pack_linear_weight(w), w.shape[0]) for w in layer] for layer in weights]
    fns = {
        "native": lambda: [
            ops.linear(x, w, None, n_out)
            for layer in panels
            for x, (w, n_out) in zip(inputs, layer, strict=True)
        ],
        "F.linear": lambda: [F.linear(x, w) for layer in weights for x, w in zip(inputs, layer, strict=True)],
    }
    if onednn_available():
        packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in layer] for layer in weights]
        fns["oneDNN"] = lambda: [
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
            for layer in packed
            for x, w in zip(inputs, layer, strict=True)
        ]
    return best_ms(fns, repeat)


def layer_caches(
    num_blocks: int, block_size: int, gen: torch.Generator
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random K/V HND caches of every layer (each layer its own, so a sweep streams from memory)."""
    return [
        (
            torch.randn(num_blocks, KV_HEADS, block_size, HEAD_DIM, generator=gen),
            torch.randn(num_blocks, KV_HEADS, block_size, HEAD_DIM, generator=gen),
        )
        for _ in range(LAYERS)
    ]


def attention_sweeps(
    ops: NativeOps,
    baseline: str,
    meta: AttentionMetadata,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, Callable[[], object]]:
    """One 30-layer ``attend`` sweep of the torch backend with the native kernels and one without
    (``baseline``), each planned into its own copy of ``meta`` (prepare() plans into extras)."""
    fns = {}
    for name, native in (("native", ops), (baseline, None)):
        backend = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
        backend.native = native
        own = dataclasses.replace(meta, extras={})
        backend.prepare(own)
        fns[name] = lambda b=backend, m=own: [b.attend(query, key, value, k, v, m) for k, v in caches]
    return fns


def decode_step(batch: int, context: int, block_size: int = 16):
    """30 layers' HND caches and one decode step's metadata: ``batch`` sequences of ``context`` tokens."""
    gen = torch.Generator().manual_seed(batch + context)
    blocks_per_seq = -(-context // block_size)
    num_blocks = 1 + batch * blocks_per_seq
    caches = layer_caches(num_blocks, block_size, gen)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).int()
    tables = order.view(batch, blocks_per_seq)
    lens = [context] * batch
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.long),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        num_decodes=batch,
        query_lens_host=[1] * batch,
        seq_lens_host=lens,
        block_size=block_size,
    )
    query = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    return caches, meta, query


def bench_decode_attention(ops: NativeOps, batch: int, context: int, repeat: int) -> dict[str, float]:
    caches, meta, query = decode_step(batch, context)
    return best_ms(attention_sweeps(ops, "gather+SDPA", meta, query, None, None, caches), repeat)


def prefill_step(seqs: int, new: int, cached: int, block_size: int = 16):
    """30 layers' HND caches and one prefill step's metadata: ``seqs`` sequences of ``new`` tokens each after
    ``cached`` tokens already in their blocks; plus the step's own K/V rows (the SDPA path reads them)."""
    gen = torch.Generator().manual_seed(seqs * new + cached)
    length = cached + new
    blocks_per_seq = -(-length // block_size)
    num_blocks = 1 + seqs * blocks_per_seq
    caches = layer_caches(num_blocks, block_size, gen)
    tables = (torch.randperm(num_blocks - 1, generator=gen) + 1).int().view(seqs, blocks_per_seq)
    tokens = seqs * new
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(tokens, dtype=torch.long),
        query_start_loc=torch.arange(0, tokens + 1, new, dtype=torch.int32),
        seq_lens=torch.full((seqs,), length, dtype=torch.int32),
        block_tables=tables,
        num_decodes=0,
        query_lens_host=[new] * seqs,
        seq_lens_host=[length] * seqs,
        block_size=block_size,
    )
    query = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen)
    key, value = (torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    return caches, meta, query, key, value


def bench_prefill_attention(
    ops: NativeOps, seqs: int, new: int, cached: int, repeat: int
) -> dict[str, float]:
    caches, meta, query, key, value = prefill_step(seqs, new, cached)
    return best_ms(attention_sweeps(ops, "SDPA", meta, query, key, value, caches), repeat)


def bench_elementwise(ops: NativeOps, tokens: int, repeat: int) -> dict[str, dict[str, float]]:
    gen = torch.Generator().manual_seed(tokens)
    gate_up = [torch.randn(tokens, 2 * INTERMEDIATE, generator=gen) for _ in range(LAYERS)]
    residual = torch.randn(tokens, HIDDEN, generator=gen)
    deltas = [torch.randn(tokens, HIDDEN, generator=gen) * 0.01 for _ in range(LAYERS)]
    weight = torch.rand(HIDDEN, generator=gen) + 0.5
    return {
        "silu_mul": best_ms(
            {
                "native": lambda: [ops.silu_mul(x) for x in gate_up],
                "torch": lambda: [reference_silu_mul(x) for x in gate_up],
            },
            repeat,
        ),
        "add_rms_norm": best_ms(
            {
                "native": lambda: [ops.add_rms_norm(residual, d, weight, 1e-5) for d in deltas],
                "torch": lambda: [reference_add_rms_norm(residual, d, weight, 1e-5) for d in deltas],
            },
            repeat,
        ),
    }


def ratio_text(ratio: float) -> str:
    """Two decimals from 1 up; three significant digits below (a busy host once timed a baseline at 1/200
    of the native time, which two decimals printed as "x 0.00")."""
    return f"{ratio:5.2f}" if ratio >= 1 else f"{ratio:5.3g}"


def row(op: str, shape: str, times: dict[str, float]) -> str:
    native = times["native"]
    others = "  ".join(
        f"{name} {ms:8.2f} ms (x{ratio_text(ms / native)})" for name, ms in times.items() if name != "native"
    )
    return f"{op:<18}{shape:<22}native {native:8.2f} ms  {others}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repetition and fewer shapes")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    repeat = 1 if args.quick else args.repeat
    torch.set_num_threads(args.threads)
    ops = load_native_ops(default_cache_dir())  # where the engine builds it: compiled once per host
    print(
        f"# native C kernels vs PyTorch, SmolLM2 shapes x {LAYERS} layers, fp32, {args.threads} threads; "
        "(xN) = baseline time / native time"
    )
    for rows in (1, 24) if args.quick else (1, 8, 16, 24, 32, 64, 96, 128):
        print(row("linear", f"rows={rows}", bench_linear(ops, rows, repeat)), flush=True)
    for batch, context in ((2, 64),) if args.quick else ((2, 176), (24, 176), (32, 300)):
        print(
            row(
                "decode_attention",
                f"batch={batch} ctx={context}",
                bench_decode_attention(ops, batch, context, repeat),
            ),
            flush=True,
        )
    for seqs, new, cached in ((2, 40, 0),) if args.quick else ((14, 146, 0), (8, 256, 0), (1, 32, 1024)):
        print(
            row(
                "prefill_attention",
                f"{seqs}x{new} after {cached}",
                bench_prefill_attention(ops, seqs, new, cached, repeat),
            ),
            flush=True,
        )
    for tokens in (24,) if args.quick else (24, 2048):
        for op, times in bench_elementwise(ops, tokens, repeat).items():
            print(row(op, f"tokens={tokens}", times), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
