"""Tiny llama GGUF files written the way llama.cpp's converter writes them (its Q/K permutation and
tensor names, gguf's own quantizer), for the tests of the GGUF converter and of quantized weights."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

# llama.cpp tensor names, written out independently of the converter's own table.
_LLAMA_CPP_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_name(hf_name: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LLAMA_CPP_NAMES[module]}.{suffix}"


def write_llama_gguf(
    path: Path,
    model_dir: Path,
    quantized: tuple[str, ...] = (),
    skip: tuple[str, ...] = (),
    types: Mapping[str, str] | None = None,
    arch: str = "llama",
) -> None:
    """A GGUF of an HF directory, written the way llama.cpp's converter writes one: tensors named in
    ``quantized`` as Q8_0, those in ``types`` as the GGUF type named there (``Q4_0``, ``F16``, …). ``arch``
    ``qwen2``/``qwen3`` prefixes the metadata so and keeps q/k rows unpermuted (llama.cpp's Qwen2Model)."""
    types = {**dict.fromkeys(quantized, "Q8_0"), **(types or {})}
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    settings = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["head_dim"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(config.get("rope_theta") or rope.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i < 3 else 1 for i in range(len(tokens))])
    writer.add_token_merges([" ".join(pair) for pair in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(settings["chat_template"])
    for hf, array in load_file(model_dir / "model.safetensors").items():
        name = gguf_name(hf)
        if name in skip:
            continue
        if arch == "llama" and ".attn_q." in name:
            array = llama_cpp_permute(array, config["num_attention_heads"])
        elif arch == "llama" and ".attn_k." in name:
            array = llama_cpp_permute(array, config["num_key_value_heads"])
        if types.get(name) == "F16":
            writer.add_tensor(name, array.astype(np.float16))
        elif name in types:
            qtype = gguf.GGMLQuantizationType[types[name]]
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
