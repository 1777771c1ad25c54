"""llama.cpp's GGUF tensor names → the HF checkpoint's, per family, and the tensors each family's file must
hold (docs/models.md#gguf; no torch needed).

Most names are shared (``blk.N.attn_q`` → ``model.layers.N.self_attn.q_proj``, …). The families differ:

- Phi-3: ``attn_qkv`` and ``ffn_up`` hold the fused q/k/v and gate/up rows, in the order of HF's
  ``qkv_proj`` / ``gate_up_proj``; ``rope_factors_long`` / ``rope_factors_short`` are LongRoPE's factors,
  which go into config.json (``gguf_families``), not into the weights;
- Gemma 2/3: four norms a layer (``attn_norm``, ``post_attention_norm``, ``ffn_norm`` = HF's
  ``pre_feedforward_layernorm``, ``post_ffw_norm``), and llama.cpp stores every norm with Gemma's unit
  offset added (``w + 1``), so the HF weight is the stored one minus 1;
- MoE: each layer's experts stacked ``[experts, rows, columns]`` per projection (``ffn_*_exps``, split back
  into one tensor per expert), the router ``ffn_gate_inp``, and Qwen2-MoE's shared expert ``ffn_*_shexp``
  with its gate ``ffn_gate_inp_shexp`` (a ``[hidden]`` vector where HF stores ``[1, hidden]``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

_COMMON = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GEMMA = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_SHARED_EXPERT = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
#: per HF model type, the layer tensors whose names differ from (or add to) ``_COMMON``
_FAMILY = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma2": _GEMMA,
    "gemma3_text": _GEMMA,
    "mixtral": {"ffn_gate_inp": "block_sparse_moe.gate"},
    "qwen3_moe": {"ffn_gate_inp": "mlp.gate"},
    "qwen2_moe": {"ffn_gate_inp": "mlp.gate", **_SHARED_EXPERT},
}
#: stacked experts' tensors → each expert's projection
_EXPERTS = {
    "mixtral": ("block_sparse_moe", {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}),
    **{
        family: (
            "mlp",
            {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"},
        )
        for family in ("qwen2_moe", "qwen3_moe")
    },
}
#: the layer tensors each family's file must hold (a dense layer; ``_MOE_PARTS`` replace its MLP)
_BASE_PARTS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up")
_REQUIRED = {
    "llama": (*_BASE_PARTS, "ffn_down"),
    "phi3": ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"),
}
_QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3_text")
_MOE_PARTS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
#: tensors that are no weight of the HF checkpoint: LongRoPE's factors (config.json holds them)
ROPE_FACTOR_TENSORS = {"long_factor": "rope_factors_long.weight", "short_factor": "rope_factors_short.weight"}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_NAME = re.compile(r"^([a-z_]+)\.(weight|bias)$")
_LABELS = {"llama": "Llama"}


def hf_tensor_name(gguf_name: str, model_type: str = "llama") -> str:
    """The HF parameter name for a llama.cpp tensor name of a ``model_type`` file (not a stacked expert)."""
    layer = _LAYER_NAME.match(gguf_name)
    table = {**_COMMON, **_FAMILY.get(model_type, {})}
    if layer and layer.group(2) in table:
        return f"model.layers.{layer.group(1)}.{table[layer.group(2)]}.{layer.group(3)}"
    other = _GLOBAL_NAME.match(gguf_name)
    if other and other.group(1) in _GLOBAL:
        return f"{_GLOBAL[other.group(1)]}.{other.group(2)}"
    if gguf_name == "rope_freqs.weight":
        raise ValueError(
            "GGUF has a rope_freqs tensor (Llama-3.1-style RoPE scaling); converting it is not supported"
        )
    label = _LABELS.get(model_type, model_type)
    raise ValueError(f"GGUF tensor {gguf_name!r} has no {label} equivalent; is this a {label} file?")


def hf_tensors(gguf_name: str, weight: np.ndarray, config: Mapping[str, Any]) -> list[tuple[str, np.ndarray]]:
    """The HF tensors one float32 GGUF tensor holds: itself renamed (a Gemma norm less its unit offset),
    or one per expert; none for LongRoPE's factors."""
    model_type = config["model_type"]
    if gguf_name in ROPE_FACTOR_TENSORS.values():
        return []
    layer = _LAYER_NAME.match(gguf_name)
    if layer and model_type in _EXPERTS:
        module, experts = _EXPERTS[model_type]
        if layer.group(2) in experts:
            prefix = f"model.layers.{layer.group(1)}.{module}.experts"
            name = experts[layer.group(2)]
            return [(f"{prefix}.{e}.{name}.weight", np.ascontiguousarray(w)) for e, w in enumerate(weight)]
        if layer.group(2) == "ffn_gate_inp_shexp":
            weight = weight.reshape(1, -1)
    if model_type in ("gemma2", "gemma3_text") and gguf_name.endswith("norm.weight"):
        # exact for stored values >= 0.5 (Sterbenz), so 1 + w gives back the stored float: the (1 + w) HF
        # computes in float32
        weight = weight - np.float32(1.0)
    return [(hf_tensor_name(gguf_name, model_type), weight)]


def required_tensors(config: Mapping[str, Any]) -> set[str]:
    """The GGUF tensors a model of this config.json needs (every MoE layer sparse, as llama.cpp writes
    them)."""
    model_type = config["model_type"]
    parts = list(_REQUIRED.get(model_type, _REQUIRED["llama"]))
    if model_type in _QK_NORM_TYPES:
        parts += ["attn_q_norm", "attn_k_norm"]
    if model_type in ("gemma2", "gemma3_text"):
        parts += ["post_attention_norm", "post_ffw_norm"]
    if model_type in _EXPERTS:
        parts = [p for p in parts if p not in ("ffn_gate", "ffn_up", "ffn_down")] + list(_MOE_PARTS)
    if model_type == "qwen2_moe":
        parts += list(_SHARED_EXPERT)
    names = {"token_embd.weight", "output_norm.weight"}
    for layer in range(config["num_hidden_layers"]):
        names.update(f"blk.{layer}.{part}.weight" for part in parts)
    return names
