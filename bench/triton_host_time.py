"""Host time of the GPU decode path's Python, per call, with every Triton launch replaced by a no-op.

    python bench/triton_host_time.py [--batch 64] [--calls 2000]

On a GPU a small-batch decode step is bound by what the host does between launches, so the Python around
each kernel (argument checks, launch arithmetic, the split plan) is what this times, on the CPU: the
attention backend's ``prepare`` (once a step), its ``forward`` (RoPE and the K/V write in one launch,
then decode attention, once a layer) and the fused layer ops (two norms and the activation, once a
layer), on a 1B-like decode shape (32 query heads over 8 KV heads of 64, hidden 2048). Launches are
stubbed, so the figures leave out Triton's own launcher (tens of µs a launch) and every kernel's run
time. Compare two builds by running this from each (same host, back to back).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernels are never run; this only picks the import

import torch

from kvpilot.engine.attention.kernels.synthetic import make_paged_batch
from kvpilot.engine.attention.rotation import QKRotation
from kvpilot.engine.attention.triton_backend import TritonAttentionBackend


class _NoLaunch:
    """Stands in for a ``@triton.jit`` function: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _stub_launches(backend: TritonAttentionBackend) -> None:
    import kvpilot.engine.model.fused_triton as fused

    kernels = backend.kernels(torch.device("cpu"))
    for module, names in (
        (kernels.decode, ["paged_decode_kernel"]),
        (kernels.split_kv, ["merge_splits_kernel"]),
        (kernels.kv_write, ["kv_write_kernel"]),
        (fused, ["_add_rms_norm_kernel", "_rope_kernel", "_gated_kernel"]),
    ):
        for name in names:
            setattr(module, name, _NoLaunch())


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(min(50, calls)):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="decoding sequences (default 64)")
    parser.add_argument("--calls", type=int, default=2000, help="timed calls of each (default 2000)")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.calls < 1:
        parser.error("--batch and --calls must be >= 1")
    from kvpilot.engine.model.fused_triton import TritonFusedOps

    heads, kv_heads, head_dim, hidden, inter = 32, 8, 64, 2048, 8192
    backend = TritonAttentionBackend(heads, kv_heads, head_dim, head_dim**-0.5, num_sms=132)
    _stub_launches(backend)
    batch = make_paged_batch(
        [500 + 7 * i for i in range(args.batch)],
        [1] * args.batch,
        heads,
        kv_heads,
        head_dim,
        16,
        torch.float32,
    )
    meta = batch.metadata(args.batch)
    key, value = torch.randn(args.batch, kv_heads, head_dim), torch.randn(args.batch, kv_heads, head_dim)
    backend.prepare(meta)
    ops = TritonFusedOps()
    residual, delta, weight = (
        torch.randn(args.batch, hidden),
        torch.randn(args.batch, hidden),
        torch.ones(hidden),
    )
    rotation = QKRotation(torch.arange(args.batch), torch.randn(4096, head_dim), torch.randn(4096, head_dim))
    gate_up = torch.randn(args.batch, 2 * inter)

    def fused_layer_ops() -> None:
        ops.add_rms_norm(residual, delta, weight, 1e-6)
        ops.add_rms_norm(residual, delta, weight, 1e-6)
        ops.silu_mul(gate_up)

    print(f"# host µs per call, Triton launches stubbed, {args.batch} decodes")
    for label, fn in (
        ("prepare (per step)", lambda: backend.prepare(meta)),
        (
            "attention forward (per layer)",
            lambda: backend.forward(
                batch.query, key, value, batch.key_cache, batch.value_cache, meta, rotation=rotation
            ),
        ),
        ("fused layer ops (per layer)", fused_layer_ops),
    ):
        print(f"{label:<32}{per_call_us(fn, args.calls):8.1f} µs", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
