"""GGUF files of the Qwen2 and Qwen3 architectures (llama.cpp's standard tensor names, q/k rows not
permuted, Qwen3's ``attn_q_norm``/``attn_k_norm``) convert to the exact HF tensors and serve HF's tokens.

The GGUFs are written the way llama.cpp's converter writes them (``gguf_files``) from models saved by
transformers itself; the converted directory must hold the source's tensors bit for bit, and kvpilot on the
GGUF (dequantized, and with ``quantization=gguf`` keeping Q8_0 blocks of the q/k projections) must give HF
eager's greedy tokens on the source directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf_files import write_llama_gguf
from hf_families import build_family, hf_reference, load_hf
from safetensors.numpy import load_file

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model.registry import resolve_model
from kvpilot.engine.model.tiny import write_tiny_llama

PROMPT = [(7 * i + 3) % 300 + 5 for i in range(12)]
STEPS = 16
# the fused qkv projection keeps blocks only when all three parts have the same type
QUANTIZED = tuple(f"blk.{layer}.attn_{part}.weight" for layer in (0, 1) for part in "qkv")


def source_model(arch: str, path: Path) -> Path:
    if arch == "qwen2":
        return write_tiny_llama(path, seed=5, model_type="qwen2", tie_word_embeddings=False)
    return build_family("qwen3", path, seed=5, use_sliding_window=False, num_hidden_layers=2)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_gguf_converts_exactly_and_serves_hf_tokens(tmp_path: Path, arch: str) -> None:
    source = source_model(arch, tmp_path / "source")
    gguf_path = tmp_path / f"{arch}.gguf"
    write_llama_gguf(gguf_path, source, arch=arch)
    converted = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache", progress=False)
    config = json.loads((converted / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == (arch, [f"Qwen{arch[-1]}ForCausalLM"])
    expected = {k: v for k, v in load_file(source / "model.safetensors").items() if "rotary" not in k}
    actual = load_file(converted / "model.safetensors")
    assert sorted(actual) == sorted(expected)
    for name, array in expected.items():
        assert np.array_equal(actual[name], array.astype(np.float32)), name
    if arch == "qwen3":
        assert any(".q_norm." in name for name in actual)

    hf_tokens, _ = hf_reference(load_hf(source), PROMPT, STEPS)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    tokens = LLM(str(gguf_path), dtype="float32", num_kv_blocks=32, block_size=8).generate([PROMPT], params)
    assert tokens[0].outputs[0].token_ids == hf_tokens


def test_qwen3_gguf_blocks_are_kept_in_hf_row_order(tmp_path: Path) -> None:
    """With Q8_0 q/k/v projections and ``quantization=gguf`` the blocks serve the same greedy tokens as
    their dequantized copy: rows un-permuted as for a llama file would rotate the wrong pairs."""
    source = source_model("qwen3", tmp_path / "source")
    gguf_path = tmp_path / "qwen3.gguf"
    write_llama_gguf(gguf_path, source, quantized=QUANTIZED, arch="qwen3")
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    outputs = {}
    for mode in ("gguf", "none"):
        llm = LLM(str(gguf_path), dtype="float32", num_kv_blocks=32, block_size=8, quantization=mode)
        assert llm.engine.quantization == mode
        if mode == "gguf":  # the blocks really serve the projections
            assert type(llm.engine.model.layers[0].self_attn.qkv_proj).__name__ == "QuantLinear"
        outputs[mode] = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    assert outputs["gguf"] == outputs["none"]


def test_qwen2_pre_tokenizer_splits_as_qwens_tokenizer_json() -> None:
    """``tokenizer.ggml.pre = qwen2`` (every Qwen2/2.5/3 GGUF) splits with Qwen2's regex: single digits,
    case-insensitive contractions, newline runs apart; the GPT-2 regex splits ``'M`` differently."""
    from tokenizers import Tokenizer as HFTokenizer

    from kvpilot.engine.model.gguf_tokenizer import tokenizer_files_from_gguf
    from kvpilot.engine.model.tiny import bytes_to_unicode

    tokens = ["<|endoftext|>", *[symbol for _, symbol in sorted(bytes_to_unicode().items())]]
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": []}

    def pieces(pre: str) -> list[str]:
        files = tokenizer_files_from_gguf({**metadata, "tokenizer.ggml.pre": pre}, model_max_length=64)
        splitter = HFTokenizer.from_str(files.tokenizer_json).pre_tokenizer
        return [piece for piece, _ in splitter.pre_tokenize_str("I'M 2024 models\n\n  ok")]

    assert pieces("qwen2") == ["I", "'M", "Ġ", "2", "0", "2", "4", "Ġmodels", "ĊĊ", "Ġ", "Ġok"]
    assert pieces("gpt2")[:3] == ["I", "'", "M"]
