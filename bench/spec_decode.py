"""Issue 22's measurement: prompt-lookup speculative decoding on SmolLM2 against the same engine without it,
in one process (the ratios share one stretch of this host's drifting speed).

    python bench/spec_decode.py                                   # batch 1 and the batch sweep
    python bench/spec_decode.py --k 2 4 --batches 1 2 4 8 16 --output-json bench/results/spec_decode.json

Copy-heavy chat tasks (repeat a passage, correct its typos, rename a variable in code), greedy,
``--max-tokens`` each. Per engine (plain, then ``ngram`` with each ``--k``):

1. Agreement: every task's greedy tokens must be identical to the plain engine's (exits 1 otherwise).
2. Batch-1 decode speed: each task alone; decode tok/s = (tokens - 1) / (last token - first token), summed
   over tasks (with ``--threads 1``: tokens per CPU second of the whole request, prefill included);
   ``--rounds`` rounds alternate the engines and each engine's best round counts. Also the
   acceptance rate (accepted / drafted tokens) and tokens per verification.
3. Batch sweep: B requests at once (the tasks in turn); output tok/s over the whole run,
   speculative / plain, speculation forced on at every B — where the ratio falls under 1 is where
   ``disable_by_batch_size`` should switch it off.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import kvpilot  # noqa: F401 - sets OpenMP defaults before torch loads
from kvpilot.engine import LLM, SamplingParams

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished "
    "the great lens until it shone, and wrote the weather into a leather logbook: wind from the west, "
    "a grey swell, two fishing boats returning late. In winter the storms came in quick succession and "
    "the tower hummed in the gusts, but the light never failed. Ships that had never seen him knew him "
    "by the steady sweep of his beam across the dark water."
)
TYPOS = PASSAGE.replace("climbed", "climed").replace("polished", "polishd").replace("weather", "wether")
CODE = (
    "def total(items):\n    x = 0\n    for item in items:\n        x += item.price * item.quantity\n"
    "    if x > 100:\n        x = x * 0.9\n    return x\n"
)
TASKS = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Correct the spelling mistakes in this text and return the whole corrected text:\n\n{TYPOS}",
    f"Rename the variable x to subtotal in this Python function and return the whole function:\n\n{CODE}",
]


def prompts(llm: LLM) -> list[list[int]]:
    tok = llm.engine.tokenizer
    ids = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True) for t in TASKS]
    return [list(p) for p in ids if isinstance(p, list)]


def run(llm: LLM, batch: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, float]:
    """(token ids per request, summed decode seconds per request, seconds of the whole run: wall clock,
    or with one thread this thread's CPU time, robust on a shared host)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    ids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(batch))]
    for rid, p in zip(ids, batch, strict=True):
        engine.add_request(rid, p, params)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    done, start = {}, clock()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    wall = clock() - start
    records = {r.request_id: r for r in engine.terminal_records if r.request_id in done}
    engine.terminal_records.clear()
    decode = sum(records[r].timings["finished"] - records[r].timings["first_token"] for r in ids)
    return [done[r].outputs[0].token_ids for r in ids], decode, wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--k", type=int, nargs="+", default=[4], help="num_speculative_tokens to measure")
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (1: time in thread CPU time)")
    ap.add_argument("--output-json", type=Path)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    engines = {"plain": LLM(args.model)}
    for k in args.k:
        spec = {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": args.prompt_lookup_max,
            "disable_by_batch_size": 1 << 20,  # forced on: the sweep measures where it stops paying
        }
        engines[f"ngram k={k}"] = LLM(args.model, speculative_config=spec)
    tasks = prompts(engines["plain"])
    for llm in engines.values():  # warm-up: first-call costs (weight packing, allocator) stay out
        run(llm, tasks[:1], 16)
    report: dict = {"model": args.model, "max_tokens": args.max_tokens, "batch1": {}, "sweep": {}}

    reference: list[list[int]] | None = None
    best: dict[str, tuple[float, int]] = {}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            tokens, decode = [], 0.0
            for p in tasks:
                out, d, total = run(llm, [p], args.max_tokens)
                tokens += out
                decode += total if args.threads == 1 else d
            if reference is None:
                reference = tokens
            if tokens != reference:
                print(f"{name}: greedy tokens differ from the plain engine's", file=sys.stderr)
                return 1
            produced = sum(len(t) - 1 for t in tokens)
            if name not in best or decode < best[name][0]:
                best[name] = (decode, produced)
    plain_rate = best["plain"][1] / best["plain"][0]
    print(
        f"batch 1, {len(tasks)} copy-heavy tasks, {args.max_tokens} greedy tokens max, best of {args.rounds}"
    )
    for name, (seconds, produced) in best.items():
        stats = engines[name].engine.stats
        rate = produced / seconds
        acceptance = stats.spec_accepted_tokens / stats.spec_draft_tokens if stats.spec_draft_tokens else None
        per_verify = (
            (stats.spec_accepted_tokens + stats.spec_num_drafts) / stats.spec_num_drafts
            if stats.spec_num_drafts
            else None
        )
        row = {
            "decode_tok_s": round(rate, 2),
            "ratio": round(rate / plain_rate, 3),
            "acceptance_rate": None if acceptance is None else round(acceptance, 3),
            "tokens_per_verification": None if per_verify is None else round(per_verify, 2),
        }
        report["batch1"][name] = row
        print(
            f"  {name:10s} {rate:8.1f} tok/s  x{row['ratio']:.2f}  acceptance {row['acceptance_rate']}"
            f"  tokens/verification {row['tokens_per_verification']}  (greedy tokens identical)"
        )

    print("batch sweep: output tok/s over the run, speculative / plain")
    for b in args.batches:
        batch = [tasks[i % len(tasks)] for i in range(b)]
        rates = {}
        for name, llm in engines.items():
            out, _, wall = run(llm, batch, args.max_tokens)
            rates[name] = sum(len(t) for t in out) / wall
        report["sweep"][b] = {n: round(r / rates["plain"], 3) for n, r in rates.items() if n != "plain"}
        cells = "  ".join(f"{n}: x{r / rates['plain']:.2f}" for n, r in rates.items() if n != "plain")
        print(f"  B={b:3d}  plain {rates['plain']:7.1f} tok/s  {cells}")
    if args.output_json:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
