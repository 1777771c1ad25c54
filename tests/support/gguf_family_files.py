"""Tiny Phi-3, Gemma 2, Gemma 3 and Qwen2-MoE GGUF files written the way llama.cpp's convert_hf_to_gguf.py
writes them from a transformers-saved directory: its tensor names (written out here independently of the
converter's table), Phi-3's fused tensors and LongRoPE factor tensors, Gemma's norms with the unit offset
added and no ``lm_head``, Qwen2-MoE's stacked experts and shared expert, and only the metadata keys those
converters write (so what llama.cpp fixes by itself, the Gemma layer pattern and attention scale, is left
out)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf_files import add_typed_tensor, finish, stack_experts
from safetensors.numpy import load_file

GGUF_ARCH = {"phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3", "qwen2_moe": "qwen2moe"}
_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_GEMMA_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def llama_cpp_name(hf_name: str, model_type: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    if hf_name == "lm_head.weight":
        return "output.weight"
    if hf_name.startswith("blk."):  # stacked experts and the router, already llama.cpp's
        return hf_name
    match = _LAYER.match(hf_name)
    assert match, hf_name
    table = {**_NAMES, **(_GEMMA_NAMES if model_type.startswith("gemma") else {})}
    return f"blk.{match.group(1)}.{table[match.group(2)]}.{match.group(3)}"


def write_family_gguf(
    path: Path,
    model_dir: Path,
    types: Mapping[str, str] | None = None,
    tokens: Mapping[str, Any] | None = None,
) -> None:
    """A GGUF of the HF directory ``model_dir``; tensors named in ``types`` stored as that GGUF type
    (``Q8_0``, ``F16``, …). ``tokens`` is the ``tokenizer.ggml.*`` vocabulary to write (a SentencePiece
    one); by default the directory's byte-level BPE as ``gpt2``."""
    types = dict(types or {})
    config = json.loads((model_dir / "config.json").read_text())
    model_type = config["model_type"]
    arch = GGUF_ARCH[model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    _write_hparams(writer, config, model_type)
    _write_tokenizer(writer, model_dir, tokens)
    tensors = stack_experts(load_file(model_dir / "model.safetensors"))
    if model_type == "phi3":
        for key, name in (("long_factor", "rope_factors_long"), ("short_factor", "rope_factors_short")):
            writer.add_tensor(f"{name}.weight", np.asarray(_rope(config)[key], dtype=np.float32))
    for hf, array in tensors.items():
        if model_type.startswith("gemma") and hf == "lm_head.weight":
            continue  # tied: llama.cpp's Gemma converters skip it
        name = llama_cpp_name(hf, model_type)
        if model_type.startswith("gemma") and name.endswith("norm.weight"):
            array = array + np.float32(1.0)  # convert_hf_to_gguf.py's Gemma modify_tensors
        add_typed_tensor(writer, name, array, types.get(name))
    finish(writer)


def _rope(config: Mapping[str, Any], layer_type: str = "full_attention") -> dict[str, Any]:
    params = config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 10000.0)}
    return params.get(layer_type, params) if isinstance(params.get(layer_type), dict) else params


def _write_hparams(writer: gguf.GGUFWriter, config: Mapping[str, Any], model_type: str) -> None:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = _rope(config)
    if model_type == "phi3":  # Phi3MiniModel.set_gguf_parameters / generate_extra_tensors
        partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        original = config["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_dimension_count(int(partial * hidden) // heads)
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_sliding_window(config.get("sliding_window") or 0)
        scale = config["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        return
    if model_type.startswith("gemma"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(config["sliding_window"])
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if config.get(key) is not None:
                getattr(writer, f"add_{key}")(config[key])
    if model_type == "gemma3_text":  # global layers' RoPE (the local base is llama.cpp's fixed 10000)
        writer.add_rope_freq_base(rope["rope_theta"])
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    if model_type == "qwen2_moe":
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def _write_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, tokens: Mapping[str, Any] | None) -> None:
    settings = json.loads((model_dir / "tokenizer_config.json").read_text())
    if tokens is None:
        tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
        vocab = tokenizer["model"]["vocab"]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(sorted(vocab, key=vocab.get))
        writer.add_token_types([3 if i < 3 else 1 for i in range(len(vocab))])
        writer.add_token_merges([" ".join(pair) for pair in tokenizer["model"]["merges"]])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(False)
    else:  # _set_vocab_sentencepiece
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens["tokens"])
        writer.add_token_scores(tokens["scores"])
        writer.add_token_types(tokens["types"])
        writer.add_bos_token_id(tokens["bos"])
        writer.add_eos_token_id(tokens["eos"])
        writer.add_unk_token_id(tokens["unk"])
        writer.add_pad_token_id(tokens["pad"])
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(tokens["add_space_prefix"])
    if settings.get("chat_template"):
        writer.add_chat_template(settings["chat_template"])
