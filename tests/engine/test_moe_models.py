"""Mixture-of-Experts models end to end against HF transformers' eager forward, in float32.

Tiny random Mixtral, Qwen3-MoE and Qwen2-MoE models are built with transformers' own config and model
classes (seeded) and saved by its ``save_pretrained``, so the checkpoints carry its current config format
and per-expert tensor names; the tokenizer is the tiny model's. kvpilot loads each through ``LLM`` with
prefix caching and chunked prefill on (a 24-token prompt in a 16-token budget is prefilled in two chunks;
the second run of it hits the prefix cache) and must produce HF's 32 greedy tokens with their logprobs
within 1e-4. A negative control shows the routing rule matters by far more than the tolerance.
"""

from __future__ import annotations

# Before any kernel module is imported: sets TRITON_INTERPRET=1 on CPU (collection imports this first).
from triton_device import DEVICE  # isort: skip

import json
from pathlib import Path

import pytest
from moe_models import COMMON, FAMILIES, PROMPT, STEPS, hf_greedy, write_moe_model

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model.arch import ModelArchConfig


def kvpilot_greedy(directory: Path, runs: int = 2, **engine_args) -> list[tuple[list[int], list[float], int]]:
    llm = LLM(
        str(directory),
        num_kv_blocks=64,
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        **engine_args,
    )
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    results = []
    for _ in range(runs):
        out = llm.generate([PROMPT], params)[0]
        seq = out.outputs[0]
        lps = [step[tok].logprob for tok, step in zip(seq.token_ids, seq.logprobs, strict=True)]
        results.append((seq.token_ids, lps, out.num_cached_tokens))
    return results


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, tuple[Path, list[int], list[float]]]:
    root = tmp_path_factory.mktemp("moe-models")
    built = {}
    for family in FAMILIES:
        directory = write_moe_model(root / family, family)
        built[family] = (directory, *hf_greedy(directory, family))
    return built


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_family_matches_hf_with_prefix_caching_and_chunked_prefill(moe_models, family):
    directory, hf_tokens, hf_lps = moe_models[family]
    assert len(set(hf_tokens)) > 4  # the reference does not just repeat one token
    (first, first_lps, first_cached), (second, second_lps, second_cached) = kvpilot_greedy(directory)
    assert first_cached == 0 and second_cached >= 16  # the second run reused the prompt's full blocks
    for tokens, lps in ((first, first_lps), (second, second_lps)):
        assert tokens == hf_tokens
        assert max(abs(a - b) for a, b in zip(lps, hf_lps, strict=True)) < 1e-4


def test_moe_configs_read_as_hf_builds_them(moe_models):
    mixtral = ModelArchConfig.from_dir(moe_models["mixtral"][0])
    assert mixtral.moe is not None and mixtral.model_type == "mixtral"
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.moe.renormalize) == (8, 2, True)
    qwen3 = ModelArchConfig.from_dir(moe_models["qwen3_moe"][0])
    assert qwen3.moe is not None and qwen3.qk_norm and qwen3.moe.intermediate_size == 32
    qwen2 = ModelArchConfig.from_dir(moe_models["qwen2_moe"][0])
    assert qwen2.moe is not None and qwen2.moe.sparse_layers == (True, False) and qwen2.qkv_bias
    assert (qwen2.moe.shared_expert_intermediate_size, qwen2.moe.renormalize) == (48, False)


def test_the_routing_rule_matters_more_than_the_tolerance(moe_models, tmp_path):
    # the same Qwen3-MoE weights served with norm_topk_prob flipped drift far from HF's logprobs
    directory, hf_tokens, hf_lps = moe_models["qwen3_moe"]
    flipped = tmp_path / "flipped"
    flipped.mkdir()
    for f in directory.iterdir():
        (flipped / f.name).write_bytes(f.read_bytes())
    config = json.loads((flipped / "config.json").read_text())
    config["norm_topk_prob"] = False
    (flipped / "config.json").write_text(json.dumps(config))
    ((tokens, lps, _),) = kvpilot_greedy(flipped, runs=1)
    steps = min(len(tokens), len(hf_tokens))
    assert max(abs(a - b) for a, b in zip(lps[:steps], hf_lps[:steps], strict=True)) > 1e-3


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_family_on_the_triton_backend_matches_hf(moe_models, family, monkeypatch):
    from kvpilot.engine.model import fused_moe_triton

    calls = []
    fused = fused_moe_triton.fused_moe
    monkeypatch.setattr(fused_moe_triton, "fused_moe", lambda *a: calls.append(1) or fused(*a))
    directory, hf_tokens, hf_lps = moe_models[family]
    ((tokens, lps, _),) = kvpilot_greedy(
        directory, runs=1, attention_backend="triton", device=DEVICE.type, dtype="float32"
    )
    assert calls  # the routed experts ran in the fused Triton kernel
    assert tokens == hf_tokens
    assert max(abs(a - b) for a, b in zip(lps, hf_lps, strict=True)) < 1e-4


def test_sparse_layers_follow_hf_rules_and_bad_top_k_is_refused():
    base = {**COMMON, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4}
    qwen = {**base, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2}
    arch = ModelArchConfig.from_dict({**qwen, "moe_intermediate_size": 16, "decoder_sparse_step": 2})
    assert arch.moe is not None and arch.moe.sparse_layers == (False, True, False, True)
    arch = ModelArchConfig.from_dict({**qwen, "moe_intermediate_size": 16, "mlp_only_layers": [0, 3]})
    assert arch.moe is not None and arch.moe.sparse_layers == (False, True, True, False)
    assert not arch.moe.renormalize  # HF's default norm_topk_prob is False
    mixtral = {**base, "model_type": "mixtral", "num_local_experts": 4}
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(5\) must be in 1..num_experts \(4\)"):
        ModelArchConfig.from_dict({**mixtral, "num_experts_per_tok": 5})
