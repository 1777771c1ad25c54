"""Issue 21's measurements on SmolLM2: quantized weights against the float32 path of the same engine, in
one process (so the ratios share one stretch of this host's drifting speed).

    python bench/quantization.py    # none / gguf / int8, float32 or int8 (+a8) activations: agreement, speed
    python bench/quantization.py --batches 1 16 64 --rounds 3 --output-json bench/results/quantization.json
    python bench/quantization.py --device cuda --dtype bfloat16 --methods none gguf   # the Triton GEMM

1. Agreement with ``quantization=none`` (the GGUF dequantized to float32: kvpilot's path before issue 21),
   on real prompts (chat-templated questions, raw openings), ``--tokens`` greedy tokens each:
   - teacher-forced: the quantized engine scores the float engine's own greedy continuation
     (``prompt_logprobs``); a position agrees when the float engine's token is its argmax (rank 1) — the
     issue's "greedy tokens agree on reference positions";
   - free-running: each engine generates greedily; positions before the first differing token;
   - perplexity of a fixed English text (``prompt_logprobs``), and its change against ``none``.
2. Decode speed: per batch size B, B requests (64-token seeded random prompts, no prefix sharing) are
   prefilled, then ``--steps`` decode-only engine steps are timed. ``--rounds`` rounds alternate the
   engines; each engine's best round counts; tok/s = B / step time, ratio = engine / ``none``. With
   ``--threads 1`` steps are timed in the thread's CPU time (robust on a shared host), else wall clock.
Also prints each engine's weight bytes. All engines share ``--device``, ``--dtype`` and
``--linear-backend`` (the engine's defaults: on CPU float32 with the native C kernels; on CUDA bfloat16,
the quantized GEMMs in Triton on the blocks). CUDA steps return their tokens to the host, so the wall clock
times the GPU's work.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

import kvpilot  # noqa: F401 - sets OpenMP defaults before torch loads
from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model.quantization import weights_bytes

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Explain in one sentence why the sky is blue.",
    "Write a short greeting to a new colleague.",
    "Give me a recipe for pancakes.",
    "What are the benefits of regular exercise?",
    "Summarize the plot of Romeo and Juliet.",
    "How do I reverse a list in Python?",
]
OPENINGS = [
    "Once upon a time",
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "Dear hiring manager,",
]


def real_prompts(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    chats = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in QUESTIONS
    ]
    return [tok.encode(t, add_special_tokens=False) for t in chats] + [tok.encode(t) for t in OPENINGS]


def greedy(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def teacher_forced_agreement(llm: LLM, prompts, continuations) -> tuple[int, int]:
    """(positions where ``continuations``' token is ``llm``'s argmax, positions)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([p + c for p, c in zip(prompts, continuations, strict=True)], params)
    agree = total = 0
    for out, prompt, cont in zip(outs, prompts, continuations, strict=True):
        for pos, token in enumerate(cont, start=len(prompt)):
            agree += out.prompt_logprobs[pos][token].rank == 1
            total += 1
    return agree, total


#: the fixed text of the perplexity comparison (plain English prose, ~200 tokens)
PERPLEXITY_TEXT = (
    "The river rose slowly through the spring, and by the first week of May the lower fields were under "
    "water. Farmers moved their animals to the hills and waited. In the town, the council met every "
    "evening to discuss the levee, which had held for forty years but now showed cracks along its northern "
    "side. Engineers from the capital arrived with maps and instruments, measured the flow, and warned "
    "that another storm would be too much. The mayor asked for volunteers, and within a day three hundred "
    "people were filling sandbags in the square. Children carried water to the workers; the baker kept his "
    "ovens going through the night. When the storm came, the levee bent but did not break, and the town "
    "remembered that week for the rest of the century."
)


def perplexity(llm: LLM, text: str) -> float:
    """exp of the mean negative log-likelihood of ``text``'s tokens after the first."""
    ids = llm.get_tokenizer().encode(text)
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    nll = [-out.prompt_logprobs[pos][tok].logprob for pos, tok in enumerate(ids) if pos > 0]
    return float(torch.tensor(nll).mean().exp())


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def agreement(llm: LLM, prompts: list[list[int]], reference: list[list[int]], tokens: int) -> dict:
    """Teacher-forced argmax agreement and free-running first divergence of ``llm`` against the greedy
    ``reference`` continuations (what the accuracy tables report)."""
    agree, total = teacher_forced_agreement(llm, prompts, reference)
    free = [
        first_divergence(ours, ref) for ours, ref in zip(greedy(llm, prompts, tokens), reference, strict=True)
    ]
    return {
        "teacher_forced_agree": agree,
        "teacher_forced_positions": total,
        "free_running_identical_prompts": sum(d == tokens for d in free),
        "free_running_mean_first_divergence": round(sum(free) / len(free), 1),
        "prompts": len(prompts),
    }


def agreement_text(entry: dict, tokens: int) -> str:
    agree, total = entry["teacher_forced_agree"], entry["teacher_forced_positions"]
    return (
        f"teacher-forced argmax agreement {agree}/{total} ({100 * agree / total:.1f}%); free-running: "
        f"{entry['free_running_identical_prompts']}/{entry['prompts']} prompts identical over {tokens} "
        f"tokens, mean first divergence {entry['free_running_mean_first_divergence']}"
    )


def decode_step_seconds(llm: LLM, batch: int, steps: int, seed: int, clock) -> float:
    """Mean seconds of one decode-only step of ``batch`` sequences (prefill excluded)."""
    engine = llm.engine
    rng = random.Random(seed)
    vocab = min(49000, engine.arch.vocab_size)  # SmolLM2's ids below 49000; a tiny model's below its vocab
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    ids = [f"decode-{seed}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(3, vocab) for _ in range(64)], params)
    while any(engine.sequences[r].num_output_tokens == 0 for r in ids):
        engine.step()
    engine.step()  # one untimed decode step
    start = clock()
    for _ in range(steps):
        engine.step()
    elapsed = clock() - start
    for rid in ids:
        engine.abort_request(rid)
    engine.step()
    return elapsed / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["none", "gguf", "gguf+a8", "int8", "int8+a8"],
        help="quantization values; a '+a8' suffix adds activation_quantization=int8 (else none)",
    )
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt (agreement)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--kv-cache-mib", type=int, default=512, help="each engine's KV cache")
    parser.add_argument("--device", default="auto", help="the engines' device (engine default: auto)")
    parser.add_argument("--dtype", default="auto", help="the engines' dtype (engine default: auto)")
    parser.add_argument(
        "--linear-backend", default="auto", help="the engines' linear backend (auto: triton on CUDA)"
    )
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.methods[0] != "none":
        parser.error("the first method is the reference: none")
    engines = {
        m: LLM(
            args.model,
            quantization=m.removesuffix("+a8"),
            activation_quantization="int8" if m.endswith("+a8") else "none",
            kv_cache_memory_bytes=args.kv_cache_mib << 20,
            max_num_seqs=max(args.batches),
            device=args.device,
            dtype=args.dtype,
            linear_backend=args.linear_backend,
        )
        for m in args.methods
    }
    ref = engines["none"].engine
    report: dict = {
        "model": args.model,
        "threads": args.threads,
        "device": str(ref.device),
        "dtype": str(ref.dtype).removeprefix("torch."),
        "linear_backend": ref.linear_backend,
        "methods": {},
    }
    print(f"{args.model} on {report['device']}, {report['dtype']}, linear backend {ref.linear_backend}")
    prompts = real_prompts(engines["none"])
    reference = greedy(engines["none"], prompts, args.tokens)
    for method, llm in engines.items():
        entry = report["methods"][method] = {"weights_mib": round(weights_bytes(llm.engine.model) / 2**20, 1)}
        entry["perplexity"] = round(perplexity(llm, PERPLEXITY_TEXT), 4)
        if method == "none":
            print(f"none: perplexity {entry['perplexity']} on the fixed text", flush=True)
            continue
        change = 100 * (entry["perplexity"] / report["methods"]["none"]["perplexity"] - 1)
        entry["perplexity_change_pct"] = round(change, 2)
        entry |= agreement(llm, prompts, reference, args.tokens)
        ppl = f"perplexity {entry['perplexity']} ({change:+.2f}%)"
        print(f"{method}: {agreement_text(entry, args.tokens)}; {ppl}", flush=True)
    # one thread: the thread's CPU time, which other processes on a shared host cannot stretch
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    best = {(m, b): float("inf") for m in engines for b in args.batches}
    for r in range(args.rounds):
        for batch in args.batches:
            for method, llm in engines.items():
                seconds = decode_step_seconds(llm, batch, args.steps, 1000 * r + batch, clock)
                best[method, batch] = min(best[method, batch], seconds)
    timed = "thread CPU time" if args.threads == 1 else "wall clock"
    print(f"\ndecode, best of {args.rounds} rounds of {args.steps} steps ({args.threads} threads, {timed})")
    print(
        f"{'method':>8} {'weights MiB':>12}"
        + "".join(f" {f'B={b} tok/s':>12} {'x none':>7}" for b in args.batches)
    )
    for method in engines:
        entry = report["methods"][method]
        entry["decode"] = {}
        cells = f"{method:>8} {entry['weights_mib']:>12}"
        for batch in args.batches:
            tps, ratio = batch / best[method, batch], best["none", batch] / best[method, batch]
            entry["decode"][str(batch)] = {
                "step_ms": round(1e3 * best[method, batch], 2),
                "tok_s": round(tps, 1),
            }
            entry["decode"][str(batch)]["x_none"] = round(ratio, 2)
            cells += f" {tps:>12.1f} {ratio:>7.2f}"
        print(cells)
    if args.output_json:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
