"""The projection, embedding and routed-expert weights of a GGUF (``gguf_config.GGUF_ARCHITECTURES``), kept
in their stored blocks (docs/architecture.md#quantized-weights).

The result maps module paths of ``LlamaForCausalLM`` (``layers.3.self_attn.qkv_proj``, ``embed_tokens``,
``lm_head``) to ``QuantWeight``s. As the float32 conversion (``gguf_convert``) does, q/k rows of a
``llama`` file get llama.cpp's RoPE permutation undone; a block is one row's own bytes, so moving whole
rows keeps every block intact. Fused projections (q/k/v, gate/up) concatenate their parts' rows (Phi-3's
file holds them fused already). A sparse layer's stacked experts (``ffn_{gate,up,down}_exps``, data
``[experts, rows, row_bytes]``) become one gate/up and one down weight per expert (``experts``, for
``moe_quant.QuantExperts``). A fused module whose parts differ in format (llama.cpp's Q4_K_M stores some
layers' ``attn_v`` as Q6_K beside Q4_K q/k) keeps each part in its own format (``split``). A module with a
tensor in a format the kernels do not run (F16, Q5_K, …) is listed in ``dequantized`` instead: it keeps
the float weights of the converted checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor

from kvpilot.engine.model.arch import ModelArchConfig
from kvpilot.engine.model.gguf_config import PERMUTED_ROPE_ARCHS
from kvpilot.engine.model.gguf_convert import unpermute_rope_rows
from kvpilot.engine.model.quant_formats import QuantWeight, concat_rows
from kvpilot.engine.native.quant_ops import FORMATS

#: GGUF tensor types the kernels compute on
RUNNABLE_TYPES = tuple(name for name, fmt in FORMATS.items() if not fmt.row_scales)


@dataclass
class GGUFWeights:
    #: module path → its weight in GGUF blocks
    weights: dict[str, QuantWeight] = field(default_factory=dict)
    #: module path → the GGUF types that keep it in float (no kernel for one of them)
    dequantized: dict[str, str] = field(default_factory=dict)
    #: fused module path → its parts in their own formats (they differ; each one runs)
    split: dict[str, list[QuantWeight]] = field(default_factory=dict)
    #: sparse block path (``layers.3.mlp``) → its experts' (gate/up, down) weights in blocks, one per expert
    experts: dict[str, tuple[list[QuantWeight], list[QuantWeight]]] = field(default_factory=dict)


def module_tensors(arch: ModelArchConfig) -> dict[str, list[str]]:
    """Module path → the GGUF tensors whose rows make its weight, in order."""
    fused = arch.fused_checkpoint  # Phi-3: llama.cpp keeps HF's fused q/k/v and gate/up rows
    parts = {
        "self_attn.qkv_proj": ["attn_qkv"] if fused else ["attn_q", "attn_k", "attn_v"],
        "self_attn.o_proj": ["attn_output"],
        "mlp.gate_up_proj": ["ffn_up"] if fused else ["ffn_gate", "ffn_up"],
        "mlp.down_proj": ["ffn_down"],
    }
    sparse = arch.moe.sparse_layers if arch.moe is not None else [False] * arch.num_hidden_layers
    out = {
        f"layers.{i}.{module}": [f"blk.{i}.{name}.weight" for name in names]
        for i in range(arch.num_hidden_layers)
        for module, names in parts.items()
        # a sparse layer's router stays float, its experts are read apart (``_read_experts``)
        if not (sparse[i] and module.startswith("mlp."))
    }
    if arch.moe is not None and arch.moe.shared_expert_intermediate_size:  # Qwen2-MoE's shared expert
        for i in [i for i, is_sparse in enumerate(sparse) if is_sparse]:
            shared, names = (
                f"layers.{i}.mlp.shared_expert",
                [f"blk.{i}.ffn_{p}_shexp.weight" for p in ("gate", "up")],
            )
            out[f"{shared}.gate_up_proj"] = names
            out[f"{shared}.down_proj"] = [f"blk.{i}.ffn_down_shexp.weight"]
    out["embed_tokens"] = ["token_embd.weight"]
    if not arch.tie_word_embeddings:
        out["lm_head"] = ["output.weight"]
    return out


def read_gguf_weights(gguf_path: Path, arch: ModelArchConfig) -> GGUFWeights:
    """The quantized weights of ``gguf_path`` for a model of ``arch`` (module docstring)."""
    reader = GGUFReader(gguf_path, "r")
    tensors = {t.name: t for t in reader.tensors}
    result = GGUFWeights()
    for module, names in module_tensors(arch).items():
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ValueError(f"{gguf_path} lacks {missing[0]}, which {module} needs")
        types = [tensors[n].tensor_type.name for n in names]
        if any(t not in RUNNABLE_TYPES for t in types):
            result.dequantized[module] = "+".join(dict.fromkeys(types))
            continue
        parts = [_blocks(tensors[n], arch) for n in names]
        if len(set(types)) > 1:  # e.g. Q4_K_M's Q6_K attn_v beside Q4_K q/k
            result.split[module] = parts
        else:
            result.weights[module] = parts[0] if len(parts) == 1 else concat_rows(parts)
    sparse = arch.moe.sparse_layers if arch.moe is not None else ()
    for layer in [i for i, is_sparse in enumerate(sparse) if is_sparse]:
        _read_experts(result, tensors, layer, gguf_path)
    return result


def _read_experts(result: GGUFWeights, tensors: dict[str, ReaderTensor], layer: int, gguf_path: Path) -> None:
    """One sparse layer's stacked experts (``ffn_{gate,up,down}_exps``, data ``[E, rows, row_bytes]``) as
    each expert's gate/up rows and down rows, when all three are in one runnable format."""
    names = [f"blk.{layer}.ffn_{part}_exps.weight" for part in ("gate", "up", "down")]
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"{gguf_path} lacks {missing[0]}, which layer {layer}'s experts need")
    gate, up, down = (tensors[n] for n in names)
    types = [t.tensor_type.name for t in (gate, up, down)]
    module = f"layers.{layer}.mlp"
    if len(set(types)) != 1 or types[0] not in RUNNABLE_TYPES:
        result.dequantized[module + ".experts"] = "+".join(dict.fromkeys(types))
        return
    fmt = FORMATS[types[0]]
    hidden, inter = int(gate.shape[0]), int(down.shape[0])  # GGUF lists dimensions innermost first
    gate_data, up_data, down_data = (np.asarray(t.data) for t in (gate, up, down))
    gate_up = [
        QuantWeight(fmt, torch.from_numpy(np.concatenate([g, u])), None, hidden)
        for g, u in zip(gate_data, up_data, strict=True)
    ]
    downs = [QuantWeight(fmt, torch.from_numpy(np.array(d)), None, inter) for d in down_data]
    result.experts[module] = (gate_up, downs)


def _blocks(tensor: ReaderTensor, arch: ModelArchConfig) -> QuantWeight:
    """One tensor's block rows (``[out_features, row_bytes]``, copied out of the file), q/k rows in HF's
    order."""
    data = np.asarray(tensor.data)
    permuted = arch.model_type in PERMUTED_ROPE_ARCHS
    if permuted and ".attn_q." in tensor.name:
        data = unpermute_rope_rows(data, arch.num_attention_heads)
    elif permuted and ".attn_k." in tensor.name:
        data = unpermute_rope_rows(data, arch.num_key_value_heads)
    in_features = int(tensor.shape[0])  # GGUF lists dimensions innermost first
    return QuantWeight(FORMATS[tensor.tensor_type.name], torch.from_numpy(np.array(data)), None, in_features)
