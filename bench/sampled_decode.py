"""SmolLM2 output tok/s with sampling on and off: 32 requests of 64 random prompt tokens, 64 new tokens each.

    python bench/sampled_decode.py LABEL      # prints LABEL beside each figure
    python bench/sampled_decode.py LABEL --model tiny-random --requests 4 --max-tokens 8   # (the test)

Run it for two versions of the code back to back (e.g. a worktree of the previous commit on PYTHONPATH,
then this one) to compare the sampler's share of a real model's decode step on this machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time

from kvpilot.engine import LLM, SamplingParams

CASES = {
    "temperature=1.0": SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True),
    "T=0.8 top_p=0.95 top_k=50": SamplingParams(
        temperature=0.8, top_p=0.95, top_k=50, max_tokens=64, ignore_eos=True
    ),
    "greedy": SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("label", nargs="?", default="run")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    llm = LLM(args.model, kv_cache_memory_bytes=256 << 20, max_num_seqs=args.requests)
    rng = random.Random(0)
    vocab = llm.engine.arch.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(args.requests)]
    for name, params in CASES.items():
        params = dataclasses.replace(params, max_tokens=args.max_tokens)
        llm.generate(prompts[:4], params)  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(
            f"{args.label:5s} {name:28s} {tokens / seconds:7.1f} output tok/s ({seconds:.2f} s)", flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
