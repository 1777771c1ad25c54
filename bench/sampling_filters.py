"""The sampler's truncation and draw against the sort-and-race baseline they replaced, in one process.

    python bench/sampling_filters.py            # 128 rows of 512 (tiny-random) and 49152 (SmolLM2) entries
    python bench/sampling_filters.py --quick    # fewer rounds, small vocabulary only (what the test runs)

Baseline: full stable sorts for top-k/top-p (``reference_top_k``/``reference_top_p``) and the exponential
race ``argmax p / E`` with one Exp(1) number per entry. Current: ``apply_top_k``/``apply_top_p`` and
``inverse_cdf_draw`` (the tensor pipeline, what a GPU runs). Native: the C kernel the engine uses on a CPU
(``engine/native/sampling.c``, one thread per core torch uses). Rows are peaked as a language model's (8
likely tokens above a long tail). Times are the best of alternating rounds; ``ratio`` = baseline / current,
``native ratio`` = current / native.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from kvpilot.engine.model.registry import default_cache_dir
from kvpilot.engine.native.ops import load_native_ops
from kvpilot.engine.native.sampling_ops import SamplingKernels
from kvpilot.engine.sampling.draw import inverse_cdf_draw
from kvpilot.engine.sampling.filters import apply_top_k, apply_top_p, reference_top_k, reference_top_p
from kvpilot.engine.sampling.params import SamplingParams
from kvpilot.engine.sampling.row_params import SamplingTensors


def truncated_probs(z: torch.Tensor, k, p, top_k_fn, top_p_fn) -> torch.Tensor:
    scaled = z / 0.8
    if k is not None:
        top_k_fn(scaled, k)
    if p is not None:
        top_p_fn(scaled, p)
    return scaled.softmax(dim=-1)


def baseline(z: torch.Tensor, k, p, gen: torch.Generator) -> torch.Tensor:
    probs = truncated_probs(z, k, p, reference_top_k, reference_top_p)
    return (probs / torch.empty_like(probs).exponential_(generator=gen)).argmax(dim=-1)


def current(z: torch.Tensor, k, p, gen: torch.Generator) -> torch.Tensor:
    probs = truncated_probs(z, k, p, apply_top_k, apply_top_p)
    return inverse_cdf_draw(probs, torch.rand(z.shape[0], generator=gen))


def native(
    kernels: SamplingKernels, values: torch.Tensor, z: torch.Tensor, gen: torch.Generator
) -> torch.Tensor:
    """``values``: the rows' ``SamplingTensors`` columns (the same T, top-k and top-p as the other runs)."""
    return kernels.draw(z, values, torch.rand(z.shape[0], generator=gen))


def row_values(rows: int, k, p) -> torch.Tensor:
    params = SamplingParams(
        temperature=0.8, top_k=-1 if k is None else int(k[0]), top_p=1.0 if p is None else float(p[0])
    )
    return SamplingTensors.from_params([params] * rows, torch.device("cpu")).values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rows", type=int, default=128)
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    kernels = load_native_ops(default_cache_dir()).sampling
    rounds = 2 if args.quick else 5
    for vocab in (512,) if args.quick else (512, 49152):
        z = torch.randn(args.rows, vocab, generator=gen) * 2
        z[:, :8] += 8
        full = torch.full((args.rows,), 1)
        cases = {
            "T=0.8": (None, None),
            "T=0.8 top_k=50 top_p=0.95": (full * 50, full * 0.95),
            "T=0.8 top_p=0.9": (None, full * 0.9),
        }
        for name, (k, p) in cases.items():
            repeat = 10 if vocab <= 4096 else 2
            best = {"baseline": float("inf"), "current": float("inf"), "native": float("inf")}
            values = row_values(args.rows, k, p)
            runs = {
                "baseline": baseline,
                "current": current,
                "native": lambda z, k, p, gen, values=values: native(kernels, values, z, gen),
            }
            for _ in range(rounds):
                for label, fn in runs.items():
                    start = time.perf_counter()
                    for _ in range(repeat):
                        fn(z, k, p, gen)
                    best[label] = min(best[label], (time.perf_counter() - start) / repeat * 1e3)
            ratio, native_ratio = best["baseline"] / best["current"], best["current"] / best["native"]
            print(
                f"{args.rows}x{vocab:<6d} {name:<26s} baseline {best['baseline']:8.2f} ms  current "
                f"{best['current']:8.2f} ms  native {best['native']:8.2f} ms  ratio {ratio:5.1f}  "
                f"native ratio {native_ratio:5.1f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
