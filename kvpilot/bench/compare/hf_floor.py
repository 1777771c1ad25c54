"""The floor of the comparison: HF transformers ``generate`` in-process, fp32, a fixed thread count.

Run as a child process of :mod:`kvpilot.bench.compare.side_by_side` (so it can be timed out, and its torch
threads and memory are gone before a server starts), or alone (outside the repo root, whose ``operator/``
shadows the stdlib module):

    python -m kvpilot.bench.compare.hf_floor --model-dir DIR --prompts prompts.json --output-len 64 \
        --threads 2 --output-json hf.json

``prompts.json`` maps a batch size to its prompts (``{"1": [...], "8": [...]}``). Each batch is one
left-padded greedy ``generate`` of exactly ``output_len`` new tokens (``min_new_tokens`` = max, the HF form
of ``ignore_eos``), timed after a warm-up ``generate`` that is excluded. Reported per batch: wall time,
output tokens/s (batch × output_len / wall), and wall / output_len (the time of one decode step, prefill
amortised in). ``--repeats`` runs each batch several times and keeps every wall time; the figure is their
median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def run_floor(
    model_dir: Path, prompts_by_batch: dict[int, list[str]], output_len: int, threads: int, repeats: int
) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    load_start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"  # decoder-only generation continues from the right edge
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    load_s = time.perf_counter() - load_start

    def generate(prompts: list[str], new_tokens: int) -> tuple[float, int]:
        batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                **batch,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        wall = time.perf_counter() - start
        return wall, (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts)

    warmup_start = time.perf_counter()
    generate(prompts_by_batch[min(prompts_by_batch)][:1], 4)
    warmup_s = time.perf_counter() - warmup_start

    batches = {}
    for size in sorted(prompts_by_batch):
        prompts = prompts_by_batch[size]
        walls, produced = [], 0
        for _ in range(repeats):
            wall, produced = generate(prompts, output_len)
            walls.append(wall)
        wall = statistics.median(walls)
        batches[str(size)] = {
            "batch": size,
            "walls_s": walls,
            "wall_s": wall,
            "output_tokens": produced,
            "output_tok_per_s": produced / wall,
            "step_s": wall / output_len,
            "prompt_tokens": [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts],
        }
        print(f"HF generate batch {size:>3}: {produced / wall:7.1f} output tok/s ({wall:.1f} s)", flush=True)
    return {
        "system": "hf",
        "threads": threads,
        "dtype": "float32",
        "output_len": output_len,
        "repeats": repeats,
        "load_s": load_s,
        "warmup_s": warmup_s,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "batches": batches,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--prompts", type=Path, required=True, help="JSON: batch size -> list of prompts")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--output-json", type=Path, required=True)
    args = ap.parse_args(argv)
    prompts = {int(size): texts for size, texts in json.loads(args.prompts.read_text()).items()}
    if not prompts or any(len(texts) != size for size, texts in prompts.items()):
        ap.error(f"{args.prompts}: each batch size must map to exactly that many prompts")
    if args.output_len < 1 or args.threads < 1 or args.repeats < 1:
        ap.error("--output-len, --threads and --repeats must be >= 1")
    result = run_floor(args.model_dir, prompts, args.output_len, args.threads, args.repeats)
    args.output_json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
