"""``kvpilot generate``: offline generation on the engine (default model: the bundled SmolLM2-135M)."""

from __future__ import annotations

import argparse
import sys
import time

from kvpilot.engine.arg_utils import add_engine_args, config_from_namespace

DEFAULT_PROMPTS = ["What is PagedAttention, in one sentence?", "Write a haiku about GPUs."]


def build_parser() -> argparse.ArgumentParser:
    # No prefix abbreviations, as kvpilot serve (engine/server/cli.py): "--max-tok" is no flag.
    p = argparse.ArgumentParser(prog="kvpilot generate", description=__doc__, allow_abbrev=False)
    p.add_argument("prompts", nargs="*", help="prompts (default: two example questions)")
    p.add_argument("--raw", action="store_true", help="send prompts as plain text, without the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    p.add_argument("--ignore-eos", action="store_true")
    add_engine_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    config = config_from_namespace(parser, ns)
    from kvpilot.engine.engine_core import LLMEngine, RequestError
    from kvpilot.engine.llm import LLM
    from kvpilot.engine.sampling.params import SamplingParams, SamplingParamsError

    try:
        params = SamplingParams(
            max_tokens=ns.max_tokens,
            temperature=ns.temperature,
            top_p=ns.top_p,
            top_k=ns.top_k,
            seed=ns.sampling_seed,
            ignore_eos=ns.ignore_eos,
        )
    except SamplingParamsError as err:
        parser.error(str(err))
    t0 = time.monotonic()
    try:
        llm_engine = LLMEngine(config)
    except (ValueError, OSError) as err:
        print(f"kvpilot generate: {err}", file=sys.stderr)
        return 1
    llm = LLM.from_engine(llm_engine)
    load_s = time.monotonic() - t0
    prompts = ns.prompts or DEFAULT_PROMPTS
    t1 = time.monotonic()
    try:
        if ns.raw:
            outs = llm.generate(prompts, params)
        else:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    except (RequestError, ValueError) as err:
        print(f"kvpilot generate: {err}", file=sys.stderr)
        return 1
    gen_s = time.monotonic() - t1
    for prompt, out in zip(prompts, outs, strict=True):
        c = out.outputs[0]
        ttft = (
            "n/a" if out.metrics is None or out.metrics.ttft is None else f"{out.metrics.ttft * 1000:.0f} ms"
        )
        print(
            f"### {prompt}\n{c.text}\n[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}, "
            f"ttft={ttft}]\n"
        )
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        f"model {llm_engine.served_model_name} ({llm_engine.dtype}, {llm_engine.device}): "
        f"loaded in {load_s:.1f} s; "
        f"{len(outs)} requests, {n_out} output tokens in {gen_s:.2f} s = {n_out / gen_s:.1f} tok/s"
    )
    return 0
