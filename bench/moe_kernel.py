"""The CPU MoE path (``moe_experts.sorted_moe``) against a per-expert-loop baseline, in the same run.

    python bench/moe_kernel.py                       # both shapes, 1 / 16 / 256 tokens
    python bench/moe_kernel.py --shape qwen3 --tokens 16 --iters 20

``baseline`` is how transformers' eager ``MixtralExperts`` / ``Qwen3MoeExperts`` compute the routed
experts (the loop kvpilot would run without its own path): a one-hot mask of the routing, then for every
expert that some token chose a ``torch.where`` over its mask, a gather of its tokens, the two
projections and an ``index_add_`` into the output. ``sorted`` is the engine's CPU path: one stable sort
of the assignments by expert, one read of the counts, then one GEMM pair per non-empty expert over
contiguous rows and one scatter back, with the SiLU-and-multiply through the native C kernel as in the
engine (``--no-native``: PyTorch's). Both get the same float32 weights and routing, and their outputs are
checked equal before timing. The two run alternately, call by call, so a shared host's load changes hit
both alike; prints the median milliseconds per call of each and baseline / sorted.

Shapes (hidden, expert size, experts, top-k), scaled down from the real models to fit a small host:
``mixtral`` 1024, 3584, 8, 2 (Mixtral-8x7B / 4); ``qwen3`` 512, 192, 64, 8 (Qwen3-30B-A3B's 128 experts
halved, sizes / 4).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvpilot.engine.model.moe_experts import select_experts, sorted_moe
from kvpilot.engine.model.registry import default_cache_dir
from kvpilot.engine.native.ops import load_native_ops

SHAPES = {"mixtral": (1024, 3584, 8, 2), "qwen3": (512, 192, 64, 8)}


def baseline_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The routed experts as transformers' eager experts loop computes them (the baseline)."""
    experts, inter = w13.shape[0], w13.shape[1] // 2
    out = torch.zeros_like(x)
    mask = F.one_hot(ids, num_classes=experts).permute(2, 1, 0)  # [E, k, T]
    for expert in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
        e = int(expert[0])
        slot, token = torch.where(mask[e])
        gate_up = F.linear(x[token], w13[e])
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, token, F.linear(act, w2[e]) * weights[token, slot, None])
    return out


def make_inputs(shape: str, tokens: int, seed: int = 0):
    hidden, inter, experts, top_k = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    weights, ids = select_experts(torch.randn(tokens, experts, generator=g), top_k, renormalize=True)
    return x, w13, w2, weights, ids


def median_ms(fns: list[Callable[[], object]], iters: int, warmup: int) -> list[float]:
    """Median milliseconds of each of ``fns``, called in turns (the order alternating every round)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for i in range(iters):
        order = range(len(fns)) if i % 2 == 0 else reversed(range(len(fns)))
        for j in order:
            start = time.perf_counter()
            fns[j]()
            times[j].append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), action="append")
    parser.add_argument("--tokens", type=int, action="append")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-native", action="store_true", help="SiLU-and-multiply in PyTorch")
    args = parser.parse_args(argv)
    native = None if args.no_native else load_native_ops(default_cache_dir())
    print(f"torch threads: {torch.get_num_threads()}, native SiLU-and-multiply: {native is not None}")
    for shape in args.shape or sorted(SHAPES):
        for tokens in args.tokens or (1, 16, 256):
            inputs = make_inputs(shape, tokens)
            with torch.inference_mode():
                ours = sorted_moe(*inputs, native)
                torch.testing.assert_close(ours, baseline_moe(*inputs), atol=1e-4, rtol=1e-4)
                base, fast = median_ms(
                    [lambda: baseline_moe(*inputs), lambda: sorted_moe(*inputs, native)],  # noqa: B023
                    args.iters,
                    args.warmup,
                )
            print(
                f"{shape} {tokens} tokens: baseline {base:.3f} ms, sorted {fast:.3f} ms, "
                f"baseline/sorted x{base / fast:.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
