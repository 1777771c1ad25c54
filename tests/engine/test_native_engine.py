"""The engine with the fused C kernels (``native_cpu_ops``) against the same engine on PyTorch ops.

The HF-equivalence tests run with the default (``auto``: native wherever a C compiler exists, as here);
these check that both paths compute the same logits and greedy tokens for the architecture variants
(Qwen2 q/k/v biases, Mistral's sliding window, a head size other than 16) under a step mix with chunked
prefill, a prefix-cache hit and batched decodes, and that ``on``/``off``/``auto`` resolve as documented.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
from engine_runs import record_step_logits

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.config import ConfigError
from kvpilot.engine.model.tiny import write_tiny_llama

VARIANTS = {
    "llama": {},
    "qwen2-biases": {"model_type": "qwen2"},
    "mistral-window-12": {"model_type": "mistral", "sliding_window": 12},
    "head-dim-32": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32},
}
ENGINE_ARGS = {"block_size": 4, "num_kv_blocks": 160, "max_num_batched_tokens": 24, "max_num_seqs": 6}


@pytest.fixture(scope="module", params=list(VARIANTS))
def model_dir(request, tmp_path_factory):
    return write_tiny_llama(
        tmp_path_factory.mktemp(request.param) / "model", seed=3, **VARIANTS[request.param]
    )


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(18)]
    fresh = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 7, 30, 13)]
    return [[*shared, 7, 8], *fresh, [*shared, 9]]  # the last one hits the first one's cached blocks


def run(model_dir, native: str):
    llm = LLM(str(model_dir), native_cpu_ops=native, **ENGINE_ARGS)
    assert (llm.engine.native_ops is not None) == (native == "on")
    assert (llm.engine.backend.native is not None) == (native == "on")
    logits = record_step_logits(llm)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts()[:-1], params) + llm.generate(prompts()[-1:], params)
    return [o.outputs[0].token_ids for o in outs], logits, outs[-1].num_cached_tokens


def test_native_kernels_compute_what_the_pytorch_ops_do(model_dir):
    native_tokens, native_logits, native_cached = run(model_dir, "on")
    torch_tokens, torch_logits, torch_cached = run(model_dir, "off")
    assert native_cached == torch_cached == 16  # four full 4-token blocks of the shared prefix
    assert native_tokens == torch_tokens
    assert len(native_logits) == len(torch_logits) > 8
    for ours, reference in zip(native_logits, torch_logits, strict=True):
        torch.testing.assert_close(ours, reference, atol=2e-5, rtol=1e-5)


def test_native_mode_is_validated_and_resolved(tmp_path, monkeypatch, caplog):
    with pytest.raises(ConfigError, match="native_cpu_ops must be one of"):
        LLM("tiny-random", native_cpu_ops="yes")
    with pytest.raises(ValueError, match="needs float32 on CPU"):
        LLM("tiny-random", dtype="bfloat16", native_cpu_ops="on")
    assert LLM("tiny-random", dtype="bfloat16").engine.native_ops is None  # auto: not for bf16
    monkeypatch.setenv("CC", "no-such-compiler-kvpilot")
    with pytest.raises(ValueError, match="cannot be built: no C compiler"):
        LLM("tiny-random", native_cpu_ops="on")
    with caplog.at_level(logging.WARNING):
        llm = LLM("tiny-random")  # auto: falls back to PyTorch ops and says so
    assert llm.engine.native_ops is None and "using PyTorch ops" in caplog.text
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
