"""Benchmark the quantized GEMM (``quant_gemm.c``) against the float32 GEMMs the engine uses, on SmolLM2's
projections (30 layers: qkv 576→960, o 576→576, gate_up 576→3072, down 1536→576), in one process.

    python bench/quant_kernels.py                      # rows 1–2048, Q4_1 / Q8_0 / int8 vs fp32
    python bench/quant_kernels.py --rows 1 4 8 --dot-max-rows 2 4 8   # the schedule threshold

Each row times the four projections of all 30 layers (distinct weights, so each call streams from memory
as a decode step does): ``native-f32`` is the panel GEMM the engine runs up to 256 rows, ``onednn-f32``
the oneDNN-packed weights it runs beyond, then each quantized format, and (Q4_1) each weight dequantized by
the C kernel into a scratch buffer followed by ``F.linear``. ``x`` = best fp32 time / that
format's time (> 1: faster). With ``--dot-max-rows`` the library is also built with other thresholds of
the dot-product schedule and each is timed (Q4_1). Times: best of ``--repeat`` alternating rounds, in CPU
time of the thread with ``--threads 1`` (robust on a shared host), else wall clock.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from native_kernels import LAYERS, PROJECTIONS

from kvpilot.engine.model.cpu_linear import onednn_available
from kvpilot.engine.model.quant_formats import QuantWeight, quantize_int8
from kvpilot.engine.model.registry import default_cache_dir
from kvpilot.engine.native.ops import load_native_ops
from kvpilot.engine.native.quant_ops import FORMATS

QUANT_FORMATS = ("Q4_1", "Q8_0", "int8")


def best_ms(
    fns: dict[str, Callable[[], object]], repeat: int, clock: Callable[[], float]
) -> dict[str, float]:
    """Best time of each function over ``repeat`` rounds that run them in turn (as bench/native_kernels.py),
    on ``clock``: with one thread, this thread's CPU time, which other processes on a shared host cannot
    stretch (memory stalls still count)."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for name, fn in fns.items():
            start = clock()
            fn()
            best[name] = min(best[name], clock() - start)
    return {name: seconds * 1e3 for name, seconds in best.items()}


def quantized(fmt: str, w: torch.Tensor) -> QuantWeight:
    if fmt == "int8":
        return quantize_int8(w)
    blocks = gguf_quantize(w.numpy(), GGMLQuantizationType[fmt])
    return QuantWeight(FORMATS[fmt], torch.from_numpy(blocks), None, w.shape[1])


def runners(xs, ops, panels, packed, quants, variants) -> dict[str, Callable[[], None]]:
    """One closure per variant, each running the 4 projections of every layer on the inputs ``xs``."""

    def run_native():
        for layer in panels:
            for w, (inp, out) in zip(layer, PROJECTIONS, strict=True):
                ops.linear(xs[inp], w, None, out)

    def run_onednn():
        for layer in packed:
            for w, (inp, _) in zip(layer, PROJECTIONS, strict=True):
                torch.ops.mkldnn._linear_pointwise(xs[inp], w, None, "none", [], "")

    def run_quant(fmt, kernels):
        def run():
            for layer in quants[fmt]:
                for w, (inp, _) in zip(layer, PROJECTIONS, strict=True):
                    kernels.linear(xs[inp], w.data, w.scales, fmt, None)

        return run

    scratch = torch.empty(max(out * inp for inp, out in PROJECTIONS))

    def run_dequant_mm():
        for layer in quants["Q4_1"]:
            for w, (inp, out) in zip(layer, PROJECTIONS, strict=True):
                dense_w = ops.quant.dequantize(w.data, None, "Q4_1", inp, scratch[: out * inp].view(out, inp))
                torch.nn.functional.linear(xs[inp], dense_w)

    fns = {"native-f32": run_native, "deq+mm": run_dequant_mm}
    if packed is not None:
        fns["onednn-f32"] = run_onednn
    fns.update({fmt: run_quant(fmt, ops.quant) for fmt in QUANT_FORMATS})
    fns.update({f"dot{t}": run_quant("Q4_1", k) for t, k in variants.items()})
    return fns


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16, 32, 64, 256, 2048])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dot-max-rows", type=int, nargs="*", default=[])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = load_native_ops(default_cache_dir())
    g = torch.Generator().manual_seed(0)
    dense = [
        [torch.randn(out, inp, generator=g) / inp**0.5 for inp, out in PROJECTIONS] for _ in range(LAYERS)
    ]
    panels = [[ops.pack_linear_weight(w) for w in layer] for layer in dense]
    packed = (
        [[torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in layer] for layer in dense]
        if onednn_available()
        else None
    )
    quants = {fmt: [[quantized(fmt, w) for w in layer] for layer in dense] for fmt in QUANT_FORMATS}
    variants = {}
    with tempfile.TemporaryDirectory() as tmp:
        for threshold in args.dot_max_rows:
            variants[threshold] = load_native_ops(Path(tmp), (f"-DDOT_MAX_ROWS={threshold}",)).quant
    clock = "thread CPU time" if args.threads == 1 else "wall clock"
    print(
        f"threads={args.threads} vectorized={ops.quant.vectorized} "
        f"(ms of {clock} for 30 layers x 4 projections)"
    )
    header = ["rows", "native-f32", "onednn-f32", *QUANT_FORMATS, *(f"x {f}" for f in QUANT_FORMATS)]
    header += ["Q4_1 deq+mm"]
    header += [f"Q4_1 dot<={t}" for t in variants]
    print(" ".join(f"{h:>12}" for h in header))
    for rows in args.rows:
        xs = {inp: torch.randn(rows, inp, generator=g) for inp in {i for i, _ in PROJECTIONS}}

        fns = runners(xs, ops, panels, packed, quants, variants)
        ms = best_ms(fns, args.repeat, time.thread_time if args.threads == 1 else time.perf_counter)
        f32 = min(ms["native-f32"], ms.get("onednn-f32", float("inf")))
        cells = [rows, ms["native-f32"], ms.get("onednn-f32", float("nan")), *(ms[f] for f in QUANT_FORMATS)]
        cells += [f32 / ms[f] for f in QUANT_FORMATS] + [ms["deq+mm"]] + [ms[f"dot{t}"] for t in variants]
        print(" ".join(f"{c:>12}" if isinstance(c, int) else f"{c:>12.2f}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
