"""Benchmark the Triton paged-attention kernels against torch SDPA on the same shapes.

    python bench/kernels.py            # CUDA: serving-sized shapes; CPU: tiny shapes in the interpreter
    python bench/kernels.py --quick    # tiny shapes everywhere (what CI runs on CPU)

A mixed decode batch (many short contexts and one long one) is timed with the split plan per sequence
against one split count for the whole batch (the rule before it), in the same run.

Decode is bandwidth bound, so it reports achieved bandwidth: the bytes a step must move (every attended
K/V row once, plus queries and outputs) over the measured time. Prefill is compute bound: causal
attention FLOPs (QK^T and PV, 2 per multiply-add) over the time, in TFLOP/s. SDPA runs on contiguous K/V
gathered from the same paged cache (its gather is not timed, which favours SDPA), with GQA via
``enable_gqa``. ``ratio`` is SDPA time / Triton time (> 1: Triton is faster); ``max_err`` compares the
two outputs. On CPU the kernels run in the Triton interpreter, so the timings say nothing about GPUs;
that run only proves the benchmark and kernels work end to end.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpilot.engine.attention.kernels.launch_math import cdiv
from kvpilot.engine.attention.kernels.synthetic import PagedBatch, make_paged_batch
from kvpilot.engine.attention.triton_loader import TritonKernels, load_kernels


@dataclass(frozen=True)
class Shape:
    batch: int
    seq_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"B={self.batch} L={self.seq_len} H={self.num_heads}/{self.num_kv_heads} D={self.head_dim} "
            f"bs={self.block_size} {dtype}"
        )


def _shapes(device: torch.device, quick: bool) -> tuple[list[Shape], list[Shape]]:
    """(decode shapes, prefill shapes); decode ``seq_len`` counts the new token."""
    if quick or device.type != "cuda":
        # the 600-token decode is long enough for the split-KV path (and its merge kernel) on one "SM"
        return (
            [Shape(2, 48, 4, 2, 64, 16, torch.float32), Shape(1, 600, 8, 1, 128, 32, torch.float16)],
            [Shape(2, 24, 4, 2, 64, 16, torch.float32)],
        )
    bf16 = torch.bfloat16
    return (
        [
            Shape(64, 2048, 32, 8, 128, 16, bf16),
            Shape(8, 8192, 32, 8, 128, 16, bf16),
            Shape(1, 32768, 32, 8, 128, 16, bf16),
            Shape(32, 4096, 8, 1, 256, 32, bf16),
        ],
        [
            Shape(4, 2048, 32, 8, 128, 16, bf16),
            Shape(1, 8192, 32, 8, 128, 16, bf16),
            Shape(8, 1024, 16, 16, 64, 64, torch.float16),
        ],
    )


def _mixed_batches(device: torch.device, quick: bool) -> list[MixedBatch]:
    if quick or device.type != "cuda":
        return [MixedBatch(3, 40, 700, 4, 2, 64, 16, torch.float32)]
    bf16 = torch.bfloat16
    return [MixedBatch(127, 1024, 32768, 32, 8, 128, 16, bf16)]


def _timer(device: torch.device):
    """Milliseconds per call: CUDA events via triton's do_bench; wall clock (best of 2) in the interpreter."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=10, rep=50)

    def wall_clock(fn) -> float:
        best = math.inf
        for _ in range(2):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        return best * 1e3

    return wall_clock


def _contiguous_kv(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, kv_heads, L, D]`` K and V of equal-length sequences, gathered from the paged cache."""
    seq_len, block_size = int(batch.seq_lens[0]), batch.block_size
    positions = torch.arange(seq_len, device=batch.block_tables.device)
    slots = batch.block_tables[:, positions // block_size].long() * block_size + positions % block_size
    flat = (-1, *batch.key_cache.shape[2:])
    return (
        batch.key_cache.view(flat)[slots].transpose(1, 2).contiguous(),
        batch.value_cache.view(flat)[slots].transpose(1, 2).contiguous(),
    )


def _make(shape: Shape, query_len: int, device: torch.device) -> PagedBatch:
    return make_paged_batch(
        [shape.seq_len - query_len] * shape.batch,
        [query_len] * shape.batch,
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_dim,
        shape.block_size,
        shape.dtype,
        device=device,
        seed=shape.seq_len,
    )


def bench_decode(kernels: TritonKernels, shape: Shape, device: torch.device, num_sms: int, measure) -> dict:
    batch = _make(shape, 1, device)
    scale = shape.head_dim**-0.5
    plan = kernels.split_kv.plan_kv_splits([shape.seq_len] * shape.batch, shape.num_kv_heads, num_sms)
    splits = plan.num_kv_splits
    partials = (
        kernels.split_kv.allocate_partials(shape.batch, shape.num_heads, splits, shape.head_dim, device)
        if splits > 1
        else None
    )
    out = torch.empty_like(batch.query)
    config = kernels.tuning.DECODE_DEFAULT
    if device.type == "cuda":
        config = kernels.tuning.ConfigTable().tune(
            "decode",
            (),
            kernels.tuning.decode_candidates(shape.head_dim),
            lambda cfg: kernels.decode.paged_decode(
                out,
                batch.query,
                batch.key_cache,
                batch.value_cache,
                batch.block_tables,
                batch.seq_lens,
                scale,
                None,
                splits,
                partials,
                cfg,
                min_split_tokens=plan.min_split_tokens,
            ),
            measure,
        )

    def triton_decode():
        kernels.decode.paged_decode(
            out,
            batch.query,
            batch.key_cache,
            batch.value_cache,
            batch.block_tables,
            batch.seq_lens,
            scale,
            None,
            splits,
            partials,
            config,
            min_split_tokens=plan.min_split_tokens,
        )

    keys, values = _contiguous_kv(batch)
    query = batch.query.unsqueeze(2)  # [B, H, 1, D]

    def sdpa_decode():
        return F.scaled_dot_product_attention(query, keys, values, scale=scale, enable_gqa=True)

    triton_ms, sdpa_ms = measure(triton_decode), measure(sdpa_decode)
    element = batch.key_cache.element_size()
    moved = (
        2 * shape.batch * shape.seq_len * shape.num_kv_heads * shape.head_dim
        + 2 * shape.batch * shape.num_heads * shape.head_dim
    ) * element
    error = (out.float() - sdpa_decode().squeeze(2).float()).abs().max().item()
    return {
        "triton_ms": triton_ms,
        "sdpa_ms": sdpa_ms,
        "unit": "GB/s",
        "triton_rate": moved / triton_ms / 1e6,
        "sdpa_rate": moved / sdpa_ms / 1e6,
        "max_err": error,
        "note": f"splits={splits} {_brief(config)}",
    }


def bench_prefill(kernels: TritonKernels, shape: Shape, device: torch.device, measure) -> dict:
    batch = _make(shape, shape.seq_len, device)
    scale = shape.head_dim**-0.5
    out = torch.empty_like(batch.query)
    config = kernels.tuning.PREFILL_DEFAULT

    def run(cfg) -> None:
        kernels.prefill.paged_prefill(
            out,
            batch.query,
            batch.key_cache,
            batch.value_cache,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            shape.seq_len,
            scale,
            None,
            cfg,
        )

    if device.type == "cuda":
        config = kernels.tuning.ConfigTable().tune(
            "prefill", (), kernels.tuning.prefill_candidates(shape.head_dim), run, measure
        )
    keys, values = _contiguous_kv(batch)
    query = batch.query.view(shape.batch, shape.seq_len, shape.num_heads, shape.head_dim).transpose(1, 2)

    def sdpa_prefill():
        return F.scaled_dot_product_attention(
            query, keys, values, is_causal=True, scale=scale, enable_gqa=True
        )

    triton_ms, sdpa_ms = measure(lambda: run(config)), measure(sdpa_prefill)
    causal_pairs = shape.seq_len * (shape.seq_len + 1) // 2
    flops = 4 * shape.batch * shape.num_heads * shape.head_dim * causal_pairs
    expected = sdpa_prefill().transpose(1, 2).reshape(out.shape)
    error = (out.float() - expected.float()).abs().max().item()
    return {
        "triton_ms": triton_ms,
        "sdpa_ms": sdpa_ms,
        "unit": "TFLOP/s",
        "triton_rate": flops / triton_ms / 1e9,
        "sdpa_rate": flops / sdpa_ms / 1e9,
        "max_err": error,
        "note": _brief(config),
    }


@dataclass(frozen=True)
class MixedBatch:
    """Decodes of ``short`` sequences of ``short_len`` keys and one of ``long_len``: the long-context
    request among many chat turns that a per-batch split count leaves as the launch's tail."""

    short: int
    short_len: int
    long_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def describe(self) -> str:
        return (
            f"{self.short} x {self.short_len} + 1 x {self.long_len} keys, H={self.num_heads}/"
            f"{self.num_kv_heads} D={self.head_dim} {str(self.dtype).removeprefix('torch.')}"
        )


def per_batch_plan(split_kv, active_lens: list[int], num_kv_heads: int, num_sms: int):
    """The split rule before per-sequence plans (the baseline): one count for the whole launch, from the
    batch size and the longest context, every sequence's context spread over all the splits."""
    to_fill = cdiv(split_kv.PROGRAMS_PER_SM * num_sms, len(active_lens) * num_kv_heads)
    by_length = cdiv(max(active_lens), split_kv.MIN_TOKENS_PER_SPLIT)
    return split_kv.SplitPlan(max(1, min(to_fill, by_length, split_kv.MAX_KV_SPLITS)), 1)


def bench_mixed_decode(kernels: TritonKernels, mixed: MixedBatch, device, num_sms: int, measure) -> dict:
    """One decode launch over ``mixed`` with the per-batch plan and with the per-sequence plan."""
    lens = [mixed.short_len] * mixed.short + [mixed.long_len]
    batch = make_paged_batch(
        [n - 1 for n in lens],
        [1] * len(lens),
        mixed.num_heads,
        mixed.num_kv_heads,
        mixed.head_dim,
        mixed.block_size,
        mixed.dtype,
        device=device,
        seed=mixed.long_len,
    )
    split_kv = kernels.split_kv
    plans = {
        "per_batch": per_batch_plan(split_kv, lens, mixed.num_kv_heads, num_sms),
        "per_sequence": split_kv.plan_kv_splits(lens, mixed.num_kv_heads, num_sms),
    }
    result: dict = {}
    outputs = []
    for name, plan in plans.items():
        out = torch.empty_like(batch.query)
        partials = (
            split_kv.allocate_partials(len(lens), mixed.num_heads, plan.num_kv_splits, mixed.head_dim, device)
            if plan.num_kv_splits > 1
            else None
        )

        def decode(out=out, plan=plan, partials=partials):
            kernels.decode.paged_decode(
                out,
                batch.query,
                batch.key_cache,
                batch.value_cache,
                batch.block_tables,
                batch.seq_lens,
                mixed.head_dim**-0.5,
                None,
                plan.num_kv_splits,
                partials,
                min_split_tokens=plan.min_split_tokens,
            )

        result[f"{name}_ms"] = measure(decode)
        result[f"{name}_plan"] = plan
        outputs.append(out)
    result["max_err"] = (outputs[0].float() - outputs[1].float()).abs().max().item()
    return result


def _brief(config) -> str:
    block_m = f" m={config.block_m}" if config.block_m else ""
    return f"tile={config.tile_n}{block_m} w={config.num_warps} s={config.num_stages}"


def _row(kind: str, shape: Shape, result: dict) -> str:
    unit = result["unit"]
    return (
        f"{kind:<8}{shape.describe():<44}{result['triton_ms']:>11.3f}{result['sdpa_ms']:>10.3f}"
        f"{result['triton_rate']:>12.3f}{result['sdpa_rate']:>12.3f} {unit:<8}"
        f"{result['sdpa_ms'] / result['triton_ms']:>7.2f}{result['max_err']:>10.1e}  {result['note']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (always used on CPU)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--max-err",
        type=float,
        default=None,
        help="exit 1 if any Triton output differs from SDPA by more than this",
    )
    args = parser.parse_args(argv)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    kernels = load_kernels(device)  # on CPU: sets TRITON_INTERPRET=1 before the kernels are imported
    measure = _timer(device)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    decode_shapes, prefill_shapes = _shapes(device, args.quick)

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, Triton interpreter"
    print(f"# paged attention: Triton vs torch SDPA on {where}")
    if device.type != "cuda":
        print("# interpreter timings are not GPU performance; this run checks the kernels and the benchmark")
    print(
        f"{'kernel':<8}{'shape':<44}{'triton_ms':>11}{'sdpa_ms':>10}{'triton':>12}{'sdpa':>12} {'unit':<8}"
        f"{'ratio':>7}{'max_err':>10}  config"
    )
    worst = 0.0
    for shape in decode_shapes:
        result = bench_decode(kernels, shape, device, num_sms, measure)
        worst = max(worst, result["max_err"])
        print(_row("decode", shape, result), flush=True)
    # the interpreter runs programs one after another; plan the mixed batch as for 8 SMs there so both
    # plans split and the run checks their outputs agree
    mixed_sms = num_sms if device.type == "cuda" else 8
    for mixed in _mixed_batches(device, args.quick):
        result = bench_mixed_decode(kernels, mixed, device, mixed_sms, measure)
        worst = max(worst, result["max_err"])
        before, after = result["per_batch_plan"], result["per_sequence_plan"]
        print(
            f"mixed   {mixed.describe()}: per-batch splits {before.num_kv_splits} "
            f"{result['per_batch_ms']:.3f} ms, per-sequence splits <= {after.num_kv_splits} of >= "
            f"{after.min_split_tokens} keys {result['per_sequence_ms']:.3f} ms, ratio "
            f"{result['per_batch_ms'] / result['per_sequence_ms']:.2f}, max_err {result['max_err']:.1e}",
            flush=True,
        )
    for shape in prefill_shapes:
        result = bench_prefill(kernels, shape, device, measure)
        worst = max(worst, result["max_err"])
        print(_row("prefill", shape, result), flush=True)
    if args.max_err is not None and not worst <= args.max_err:
        print(f"max_err {worst:.2e} exceeds --max-err {args.max_err:.2e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
