"""MoE GGUFs as llama.cpp writes them (docs/models.md#gguf): a Mixtral file (architecture ``llama`` with
``expert_count``) and a Qwen3-MoE file (``qwen3moe``), experts stacked per projection in
``ffn_{gate,up,down}_exps`` beside the router ``ffn_gate_inp``. They convert to the transformers-saved
source's tensors bit for bit, and serve HF eager's greedy tokens, also with ``quantization=gguf`` keeping
the attention's Q8_0 blocks (the experts stay float)."""

from __future__ import annotations

# Before any kernel module is imported: sets TRITON_INTERPRET=1 on CPU (the MoE tests after this file
# launch the Triton kernels in the interpreter).
from triton_device import DEVICE  # noqa: F401  # isort: skip

import json
from pathlib import Path

import numpy as np
import pytest
from gguf_files import write_llama_gguf
from moe_models import PROMPT, STEPS, hf_greedy, write_moe_model
from safetensors.numpy import load_file

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model.registry import resolve_model

GGUF_ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe"}
ATTENTION_Q8 = tuple(f"blk.{layer}.attn_{part}.weight" for layer in (0, 1) for part in "qkv")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_gguf_converts_exactly_and_serves_hf_tokens(tmp_path: Path, family: str) -> None:
    source = write_moe_model(tmp_path / "source", family, seed=4)
    gguf_path = tmp_path / f"{family}.gguf"
    write_llama_gguf(gguf_path, source, arch=GGUF_ARCH[family])
    converted = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache", progress=False)
    config = json.loads((converted / "config.json").read_text())
    assert config["model_type"] == family
    expected = load_file(source / "model.safetensors")
    actual = load_file(converted / "model.safetensors")
    assert sorted(actual) == sorted(expected)
    for name, array in expected.items():
        assert np.array_equal(actual[name], array.astype(np.float32)), name

    hf_tokens, _ = hf_greedy(source, family)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    llm = LLM(str(gguf_path), dtype="float32", num_kv_blocks=64, block_size=8, quantization="none")
    assert llm.generate([PROMPT], params)[0].outputs[0].token_ids == hf_tokens


def test_a_mixtral_gguf_keeps_its_attention_blocks_and_float_experts(tmp_path: Path) -> None:
    source = write_moe_model(tmp_path / "source", "mixtral", seed=4)
    gguf_path = tmp_path / "mixtral-q8.gguf"
    write_llama_gguf(gguf_path, source, quantized=ATTENTION_Q8)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    args = {"dtype": "float32", "num_kv_blocks": 64, "block_size": 8, "activation_quantization": "none"}
    blocks = LLM(str(gguf_path), quantization="gguf", **args)  # float32 activations: exact products
    assert blocks.engine.quantization == "gguf"
    dequantized = LLM(str(gguf_path), dtype="float32", num_kv_blocks=64, block_size=8, quantization="none")
    want = dequantized.generate([PROMPT], params)[0].outputs[0].token_ids
    assert blocks.generate([PROMPT], params)[0].outputs[0].token_ids == want
