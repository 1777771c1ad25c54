"""Phi-3, Gemma 2, Gemma 3 and Qwen2-MoE GGUFs as llama.cpp writes them (docs/models.md#gguf) convert to the
transformers-saved source's tensors and serve HF eager's tokens.

Each tiny model is built and saved by transformers' own classes (``hf_families``, ``moe_models``), written
to a GGUF the way convert_hf_to_gguf.py writes it (``gguf_family_files``: Phi-3's fused tensors and
LongRoPE factor tensors, Gemma's norms with the unit offset added, Qwen2-MoE's stacked and shared experts,
only the metadata llama.cpp writes), and served by kvpilot from the GGUF with prefix caching and chunked
prefill on: HF's greedy tokens for 32 steps, and each greedy and sampled token's logprob within 1e-4. With
Q8_0 attention tensors and ``quantization=gguf`` the kept blocks serve their dequantized copy's tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_family_files import write_family_gguf
from hf_families import build_family, hf_reference, load_hf
from moe_models import write_moe_model
from safetensors.numpy import load_file

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model.arch import ModelArchConfig
from kvpilot.engine.model.registry import resolve_model

STEPS = 32
LONG = [(7 * i + 3) % 300 + 5 for i in range(20)]  # > the 16-token budget: prefilled in two chunks
SAMPLED = [(3 * i + 11) % 280 + 9 for i in range(9)]
ENGINE_ARGS = {
    "dtype": "float32",
    "block_size": 4,
    "num_kv_blocks": 160,
    "max_num_batched_tokens": 16,
    "max_num_seqs": 4,
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
SAMPLE = SamplingParams(temperature=1.0, seed=1234, max_tokens=STEPS, ignore_eos=True, logprobs=0)
#: family → overrides fitting what llama.cpp's GGUF can say: its Gemma attention scale is head_dim ** -0.5
#: (below 27B) and Gemma 3's layer pattern five local layers then a global one
SOURCES = {
    "phi3": {},
    "phi3-partial": {},
    "gemma2": {"query_pre_attn_scalar": 16},
    "gemma3": {"num_hidden_layers": 6, "sliding_window_pattern": 6},
    "qwen2_moe": {"mlp_only_layers": []},  # llama.cpp's qwen2moe has every layer sparse
}
#: per family, layer 0's attention tensors stored as Q8_0 (kept as blocks under quantization=gguf)
Q8_ATTENTION = {
    "phi3": ("blk.0.attn_qkv.weight",),
    **{f: tuple(f"blk.0.attn_{p}.weight" for p in "qkv") for f in ("gemma2", "gemma3", "qwen2_moe")},
}


def source_model(family: str, path: Path) -> Path:
    if family == "qwen2_moe":
        return write_moe_model(path, "qwen2_moe", seed=4, **SOURCES[family])
    return build_family(family, path, seed=3, **SOURCES[family])


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-families")
    return {family: source_model(family, root / family) for family in SOURCES}


@pytest.mark.parametrize("family", sorted(SOURCES))
def test_gguf_converts_to_the_source_tensors(sources, tmp_path: Path, family: str) -> None:
    source = sources[family]
    gguf_path = tmp_path / f"{family}.gguf"
    write_family_gguf(gguf_path, source)
    converted = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache", progress=False)
    expected = {k: v for k, v in load_file(source / "model.safetensors").items() if "rotary" not in k}
    actual = load_file(converted / "model.safetensors")
    assert sorted(actual) == sorted(expected)
    gemma = family.startswith("gemma")
    for name, array in expected.items():
        if gemma and name.endswith("norm.weight"):  # stored as 1 + w: the (1 + w) the model uses is exact
            assert np.array_equal(actual[name] + np.float32(1), array + np.float32(1)), name
        else:
            assert np.array_equal(actual[name], array), name
    ours, theirs = ModelArchConfig.from_dir(converted), ModelArchConfig.from_dir(source)
    for field in (
        "layer_windows",
        "rotary_dim",
        "attention_scale",
        "rope_theta",
        "rope_scaling",
        "local_rope",
    ):
        assert getattr(ours, field) == getattr(theirs, field), field
    for field in ("attn_logit_softcap", "final_logit_softcap", "moe", "tie_word_embeddings", "qk_norm"):
        assert getattr(ours, field) == getattr(theirs, field), field


@pytest.mark.parametrize("family", sorted(SOURCES))
def test_gguf_serves_hf_greedy_tokens_and_logprobs(sources, tmp_path: Path, family: str) -> None:
    source = sources[family]
    gguf_path = tmp_path / f"{family}.gguf"
    write_family_gguf(gguf_path, source)
    hf = load_hf(source)
    hf_tokens, hf_logprobs = hf_reference(hf, LONG, STEPS)
    llm = LLM(str(gguf_path), quantization="none", **ENGINE_ARGS)
    greedy = llm.generate([LONG], GREEDY)[0].outputs[0]
    assert greedy.token_ids == hf_tokens
    ours = [step[t].logprob for t, step in zip(greedy.token_ids, greedy.logprobs, strict=True)]
    assert max(abs(a - b) for a, b in zip(ours, hf_logprobs, strict=True)) < 1e-4
    sampled = llm.generate([SAMPLED], SAMPLE)[0].outputs[0]
    drawn = sampled.token_ids
    _, hf_sampled = hf_reference(hf, SAMPLED, STEPS, choose=lambda step, _: drawn[step])
    ours = [step[t].logprob for t, step in zip(drawn, sampled.logprobs, strict=True)]
    assert max(abs(a - b) for a, b in zip(ours, hf_sampled, strict=True)) < 1e-4
    assert len(set(drawn)) > 8  # really sampled


@pytest.mark.parametrize("family", sorted(Q8_ATTENTION))
def test_kept_q8_blocks_serve_their_dequantized_tokens(sources, tmp_path: Path, family: str) -> None:
    gguf_path = tmp_path / f"{family}-q8.gguf"
    write_family_gguf(gguf_path, sources[family], types=dict.fromkeys(Q8_ATTENTION[family], "Q8_0"))
    outputs = {}
    for mode in ("gguf", "none"):
        # float32 activations: the blocks' exact products (int8 activations round them)
        llm = LLM(str(gguf_path), quantization=mode, activation_quantization="none", **ENGINE_ARGS)
        qkv = type(llm.engine.model.layers[0].self_attn.qkv_proj).__name__
        assert (qkv == "QuantLinear") == (mode == "gguf")
        outputs[mode] = llm.generate([LONG], GREEDY)[0].outputs[0].token_ids
    assert outputs["gguf"] == outputs["none"]


def test_an_unsupported_gguf_architecture_is_refused_naming_the_supported_ones(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    supported = "llama, qwen2, qwen3, qwen2moe, qwen3moe, phi3, gemma2, gemma3"
    with pytest.raises(
        ValueError, match=f"GGUF architecture 'mamba' is not supported; supported: {supported}$"
    ):
        resolve_model(str(path), cache_dir=tmp_path / "cache", progress=False)
    assert not list((tmp_path / "cache" / "models").iterdir())


def test_gemma_attention_scale_and_layer_pattern_follow_llama_cpp() -> None:
    """What the file does not say, llama.cpp decides by itself: the 27B Gemmas (by layer count) scale
    attention by hidden / heads, and a Gemma 3 file without a window attends globally everywhere."""
    from kvpilot.engine.model.gguf_config import hf_config

    def config(arch: str, layers: int, window: int) -> dict:
        metadata = {
            "general.architecture": arch,
            f"{arch}.embedding_length": 4608,
            f"{arch}.attention.head_count": 32,
            f"{arch}.attention.head_count_kv": 16,
            f"{arch}.attention.key_length": 128,
            f"{arch}.attention.value_length": 128,
            f"{arch}.block_count": layers,
            f"{arch}.feed_forward_length": 36864,
            f"{arch}.context_length": 8192,
            f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
            f"{arch}.attention.sliding_window": window,
        }
        return hf_config(metadata, {"token_embd.weight"}, vocab_rows=256000)

    assert config("gemma2", 46, 4096)["query_pre_attn_scalar"] == 144  # Gemma 2 27B
    assert config("gemma2", 42, 4096)["query_pre_attn_scalar"] == 128  # Gemma 2 9B: head_dim
    assert config("gemma3", 62, 1024)["query_pre_attn_scalar"] == 144
    gemma3 = config("gemma3", 12, 1024)
    assert gemma3["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 2
    assert gemma3["rope_local_base_freq"] == 10000.0
    assert set(config("gemma3", 12, 0)["layer_types"]) == {"full_attention"}
    assert json.dumps(gemma3)  # plain JSON values only
