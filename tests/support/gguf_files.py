"""Tiny llama GGUF files written the way llama.cpp's converter writes them (its Q/K permutation and
tensor names, gguf's own quantizer, MoE experts stacked per projection), for the tests of the GGUF converter
and of quantized weights."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
from k_quants import quantize_q4_k, quantize_q6_k
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


_EXPERT_PARTS = {
    "w1": "ffn_gate_exps",
    "w3": "ffn_up_exps",
    "w2": "ffn_down_exps",
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight$")
_ROUTER = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight$")


def stack_experts(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """convert_hf_to_gguf.py's MoE handling: each layer's experts stacked into one ``[experts, rows,
    columns]`` tensor per projection, the router as ``ffn_gate_inp``; other tensors keep their HF names."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, array in tensors.items():
        if m := _EXPERT.match(name):
            experts.setdefault(f"blk.{m.group(1)}.{_EXPERT_PARTS[m.group(3)]}.weight", {})[
                int(m.group(2))
            ] = array
        elif m := _ROUTER.match(name):
            out[f"blk.{m.group(1)}.ffn_gate_inp.weight"] = array
        else:
            out[name] = array
    for name, by_expert in experts.items():
        out[name] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def gguf_name(hf_name: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    if hf_name.startswith("blk."):  # already llama.cpp's (stacked experts, router)
        return hf_name
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LLAMA_CPP_NAMES[module]}.{suffix}"


#: gguf-py cannot write K-quants: tests/support/k_quants.py does
K_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}


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
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_rope_dimension_count(head_dim)
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:  # Mixtral writes arch llama, Qwen3-MoE qwen3moe
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if config.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
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
    for hf, array in stack_experts(load_file(model_dir / "model.safetensors")).items():
        name = gguf_name(hf)
        if name in skip:
            continue
        if arch == "llama" and ".attn_q." in name:
            array = llama_cpp_permute(array, config["num_attention_heads"])
        elif arch == "llama" and ".attn_k." in name:
            array = llama_cpp_permute(array, config["num_key_value_heads"])
        add_typed_tensor(writer, name, array, types.get(name))
    finish(writer)


def add_typed_tensor(writer: gguf.GGUFWriter, name: str, array: np.ndarray, type_name: str | None) -> None:
    """``array`` as tensor ``name`` in the GGUF type ``type_name`` (None: as it is; ``F16``; a quantized
    type by gguf's quantizer, K-quants by ``k_quants``)."""
    if type_name is None:
        writer.add_tensor(name, array)
    elif type_name == "F16":
        writer.add_tensor(name, array.astype(np.float16))
    else:
        qtype = gguf.GGMLQuantizationType[type_name]
        blocks = (
            K_QUANTIZERS[type_name](array)
            if type_name in K_QUANTIZERS
            else gguf.quants.quantize(array, qtype)
        )
        writer.add_tensor(name, blocks, raw_dtype=qtype)


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
