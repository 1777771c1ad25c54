"""Greedy outputs are token-identical to HF transformers' LlamaForCausalLM with the same weights, under
plain batching, prefix caching, chunked prefill and preemption (recompute and swap). Invariants are checked
after every engine step."""

from __future__ import annotations

import random

import pytest
import torch
from engine_device import ENGINE_DEVICE
from engine_runs import run_checked
from transformers import LlamaForCausalLM as HFLlama

from kvpilot.engine import LLM, SamplingParams

MAX_NEW = 10


def hf_greedy(hf: HFLlama, prompt: list[int], n: int) -> list[int]:
    """Reference: HF forward with its own KV cache, argmax each step (first maximum on ties)."""
    out: list[int] = []
    with torch.no_grad():
        res = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            res = hf(torch.tensor([[tok]]), past_key_values=res.past_key_values, use_cache=True)
    return out


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    return HFLlama.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()


def mixed_prompts(seed: int, count: int, lo: int, hi: int, vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def assert_matches_hf(hf_tiny, prompts, outs):
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf_tiny, p, MAX_NEW), f"prompt of {len(p)} tokens diverged"


def test_plain_batching_matches_hf(hf_tiny):
    prompts = mixed_prompts(0, 8, 1, 40)
    llm = LLM("tiny-random", **ENGINE_DEVICE, num_kv_blocks=256, block_size=4, enable_prefix_caching=False)
    outs = run_checked(llm, prompts, GREEDY)
    assert_matches_hf(hf_tiny, prompts, outs)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_prefix_caching_with_shared_prefixes_matches_hf(hf_tiny):
    rng = random.Random(1)
    shared = [[rng.randrange(3, 500) for _ in range(23)] for _ in range(2)]
    prompts = [shared[i % 2] + [rng.randrange(3, 500) for _ in range(rng.randint(1, 9))] for i in range(8)]
    llm = LLM("tiny-random", **ENGINE_DEVICE, num_kv_blocks=256, block_size=4, enable_prefix_caching=True)
    first = run_checked(llm, prompts[:2], GREEDY)
    second = run_checked(llm, prompts[2:], GREEDY)
    assert_matches_hf(hf_tiny, prompts, first + second)
    # the second wave reuses the 5 full blocks (20 tokens) of its shared 23-token prefix
    assert [o.num_cached_tokens for o in first] == [0, 0]
    assert all(o.num_cached_tokens >= 20 for o in second)


def test_chunked_prefill_budget_32_matches_hf(hf_tiny):
    prompts = mixed_prompts(2, 6, 30, 90)
    llm = LLM(
        "tiny-random",
        **ENGINE_DEVICE,
        num_kv_blocks=512,
        block_size=8,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        enable_chunked_prefill=True,
    )
    outs = run_checked(llm, prompts, GREEDY)
    assert_matches_hf(hf_tiny, prompts, outs)
    assert llm.engine.num_steps > sum(len(p) for p in prompts) // 32  # prompts really were split


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_small_pool_preempts_and_still_matches_hf(hf_tiny, mode):
    prompts = mixed_prompts(3, 6, 10, 30)
    extra = {"swap_space": 0.01} if mode == "swap" else {}
    llm = LLM(
        "tiny-random",
        **ENGINE_DEVICE,
        num_kv_blocks=24,
        block_size=4,
        max_num_seqs=6,
        preemption_mode=mode,
        enable_prefix_caching=False,
        **extra,
    )
    outs = run_checked(llm, prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_matches_hf(hf_tiny, prompts, outs)
    if mode == "swap":
        assert llm.engine.kv.swap.num_free == llm.engine.kv.swap.num_blocks  # all host blocks returned
