"""Issue 21's KV-cache measurements on SmolLM2: ``kv_cache_dtype`` fp8 and int8 against ``auto`` (the
activations' float32) in the same engine and process (docs/architecture.md#kv-cache-dtype).

    python bench/kv_cache_dtype.py                                  # auto / fp8 / int8
    python bench/kv_cache_dtype.py --threads 1 --output-json bench/results/kv_cache_dtype.json

1. Accuracy against ``auto``, as ``bench/quantization.py`` measures weights (same prompts, text and
   definitions): perplexity of the fixed text and its change; teacher-forced argmax agreement on ``auto``'s
   greedy continuations; free-running greedy decoding, mean position of the first differing token.
   Every token, the prompt's included, attends K/V read back from the quantized cache.
2. What scale fp8 needs: over every K and V ``auto`` has cached (the prompts, their continuations and the
   fixed text), the largest magnitude (a
   per-tensor scale of 1 saturates above 448) and the share of values in e4m3's subnormal range (below
   2^-6, where it keeps fewer than 3 significant bits); per layer, the worst.
3. Capacity: KV blocks of each dtype in the same ``--kv-cache-mib`` budget.
4. Decode speed (``--batches``): decode-only steps timed as ``bench/quantization.py`` does, ratio to
   ``auto`` (the C kernels dequantize as they read).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from quantization import (
    PERPLEXITY_TEXT,
    agreement,
    agreement_text,
    decode_step_seconds,
    greedy,
    perplexity,
    real_prompts,
)

import kvpilot  # noqa: F401 - sets OpenMP defaults before torch loads
from kvpilot.engine import LLM

KV_DTYPES = ("auto", "fp8", "int8")
#: e4m3's smallest normal: below it values keep fewer than 3 significant bits
FP8_MIN_NORMAL = 2.0**-6


def kv_value_ranges(llm: LLM) -> dict:
    """Range facts of the float cache's K and V over every block it has written so far (the budget is
    large enough that nothing was overwritten)."""
    cache = llm.engine.kv_cache
    used = [b for b in range(1, cache.num_blocks) if bool(cache.layers[0].key[b].any())]
    facts: dict = {"blocks": len(used), "layers": []}
    for layer in cache.layers:
        row = {}
        for name, tensor in (("k", layer.key), ("v", layer.value)):
            values = tensor[used].flatten()
            values = values[values != 0]
            row[f"{name}_absmax"] = round(float(values.abs().max()), 3)
            row[f"{name}_subnormal_pct"] = round(
                100 * float((values.abs() < FP8_MIN_NORMAL).float().mean()), 3
            )
        facts["layers"].append(row)
    for key in ("k_absmax", "v_absmax", "k_subnormal_pct", "v_subnormal_pct"):
        facts[f"worst_{key}"] = max(row[key] for row in facts["layers"])
    return facts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt (agreement)")
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 16])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--kv-cache-mib", type=int, default=256, help="each engine's KV budget")
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engines = {
        kv: LLM(
            args.model,
            kv_cache_dtype=kv,
            kv_cache_memory_bytes=args.kv_cache_mib << 20,
            max_num_seqs=max([*args.batches, 16]),
        )
        for kv in KV_DTYPES
    }
    report: dict = {
        "model": args.model,
        "threads": args.threads,
        "kv_cache_mib": args.kv_cache_mib,
        "dtypes": {},
    }
    prompts = real_prompts(engines["auto"])
    reference = greedy(engines["auto"], prompts, args.tokens)
    for kv, llm in engines.items():
        engine = llm.engine
        entry = report["dtypes"][kv] = {
            "kv_blocks": engine.kv_cache.num_blocks,
            "bytes_per_token": engine.kv_bytes_per_token,
            "perplexity": round(perplexity(llm, PERPLEXITY_TEXT), 4),
        }
        blocks_x = entry["kv_blocks"] / report["dtypes"]["auto"]["kv_blocks"]
        print(
            f"{kv}: {entry['kv_blocks']} blocks ({entry['bytes_per_token']} B/token, x{blocks_x:.2f})",
            flush=True,
        )
        if kv == "auto":
            print(f"auto: perplexity {entry['perplexity']} on the fixed text", flush=True)
            continue
        change = 100 * (entry["perplexity"] / report["dtypes"]["auto"]["perplexity"] - 1)
        entry["perplexity_change_pct"] = round(change, 2)
        entry |= agreement(llm, prompts, reference, args.tokens)
        print(
            f"{kv}: perplexity {entry['perplexity']} ({change:+.2f}%); {agreement_text(entry, args.tokens)}",
            flush=True,
        )
    ranges = report["auto_kv_ranges"] = kv_value_ranges(engines["auto"])
    print(
        f"auto cache ({ranges['blocks']} written blocks): |K| max {ranges['worst_k_absmax']}, |V| max "
        f"{ranges['worst_v_absmax']}; below 2^-6 (fp8 subnormal): K {ranges['worst_k_subnormal_pct']}%, "
        f"V {ranges['worst_v_subnormal_pct']}% (worst layer)",
        flush=True,
    )
    if args.batches:
        clock = time.thread_time if args.threads == 1 else time.perf_counter
        best = {(kv, b): float("inf") for kv in engines for b in args.batches}
        for r in range(args.rounds):
            for batch in args.batches:
                for kv, llm in engines.items():
                    seconds = decode_step_seconds(llm, batch, args.steps, 1000 * r + batch, clock)
                    best[kv, batch] = min(best[kv, batch], seconds)
        timed = "thread CPU time" if args.threads == 1 else "wall clock"
        print(
            f"\ndecode, best of {args.rounds} rounds of {args.steps} steps ({args.threads} threads, {timed})"
        )
        print(f"{'kv':>6}" + "".join(f" {f'B={b} tok/s':>12} {'x auto':>7}" for b in args.batches))
        for kv in engines:
            cells = f"{kv:>6}"
            report["dtypes"][kv]["decode"] = {}
            for batch in args.batches:
                tps, ratio = batch / best[kv, batch], best["auto", batch] / best[kv, batch]
                report["dtypes"][kv]["decode"][str(batch)] = {
                    "tok_s": round(tps, 1),
                    "x_auto": round(ratio, 2),
                }
                cells += f" {tps:>12.1f} {ratio:>7.2f}"
            print(cells)
    if args.output_json:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
