"""The config.json keys of Phi-3 and Gemma 2/3 GGUFs, read the way llama.cpp reads their metadata
(docs/models.md#gguf; no torch needed).

- ``phi3``: ``rope.dimension_count`` below the head size is partial rotary (Phi-4-mini); LongRoPE is the
  presence of the ``rope_factors_long`` / ``rope_factors_short`` tensors (one factor per rotated pair) with
  ``rope.scaling.original_context_length``; llama.cpp's ``rope.scaling.attn_factor`` is HF's default
  magnitude factor unless the file says otherwise; ``attention.sliding_window`` 0 means none (Phi-4).
- ``gemma2`` / ``gemma3``: llama.cpp fixes what the file does not carry: the layer pattern (Gemma 2 slides
  on even layers, Gemma 3 on five of every six), Gemma 3's local RoPE base (10000 unless
  ``rope.freq_base_swa``), and the attention scale: ``head_dim ** -0.5``, or ``(hidden / heads) ** -0.5``
  for the 27B models, which it knows by their layer count (46 for Gemma 2, 62 for Gemma 3) — HF's
  ``query_pre_attn_scalar``. Soft-caps are read when present (transformers' defaults otherwise, as
  llama.cpp's); a window of 0 or none makes every layer global.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

#: layers of the 27B Gemma models, whose attention scale llama.cpp takes from hidden / heads
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
#: one global layer after this many minus one sliding ones (llama.cpp's ``set_swa_pattern``)
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA3_LOCAL_BASE = 10000.0


def family_config(
    arch: str,
    metadata: Mapping[str, Any],
    head_dim: int,
    rope_factors: Mapping[str, list[float]],
) -> dict[str, Any]:
    """The config.json keys ``arch`` adds to (or replaces in) the shared ones; {} for the others."""
    if arch == "phi3":
        return _phi3(metadata, head_dim, rope_factors)
    if arch in _GEMMA_PATTERN:
        return _gemma(arch, metadata, head_dim)
    if rope_factors:
        raise ValueError(f"GGUF architecture {arch!r} has LongRoPE factor tensors; only phi3 uses them")
    return {}


def _phi3(metadata: Mapping[str, Any], head_dim: int, rope_factors: Mapping[str, list[float]]) -> dict:
    rotary = int(metadata.get("phi3.rope.dimension_count", head_dim))
    out: dict[str, Any] = {"sliding_window": int(metadata.get("phi3.attention.sliding_window") or 0) or None}
    if rotary != head_dim:
        if not 0 < rotary < head_dim or rotary % 2 or int(head_dim * (rotary / head_dim)) != rotary:
            raise ValueError(
                f"GGUF phi3.rope.dimension_count={rotary} is not a part of the {head_dim}-dim head"
            )
        out["partial_rotary_factor"] = rotary / head_dim
    if not rope_factors:
        return out
    if sorted(rope_factors) != ["long_factor", "short_factor"]:
        raise ValueError("GGUF phi3 has one of rope_factors_long / rope_factors_short but not the other")
    for key, factors in rope_factors.items():
        if len(factors) != rotary // 2:
            raise ValueError(f"GGUF phi3 {key} has {len(factors)} values; RoPE rotates {rotary // 2} pairs")
    original = metadata.get("phi3.rope.scaling.original_context_length")
    if original is None:
        raise ValueError("GGUF phi3 LongRoPE factors need phi3.rope.scaling.original_context_length")
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        **{k: list(v) for k, v in sorted(rope_factors.items())},
    }
    stored = metadata.get("phi3.rope.scaling.attn_factor")
    ratio = int(metadata["phi3.context_length"]) / int(original)
    default = math.sqrt(1 + math.log(ratio) / math.log(int(original))) if ratio > 1 else 1.0
    if stored is not None and not math.isclose(float(stored), default, rel_tol=1e-6):
        scaling["attention_factor"] = float_value(stored)
    out.update(rope_scaling=scaling, original_max_position_embeddings=int(original))
    return out


def _gemma(arch: str, metadata: Mapping[str, Any], head_dim: int) -> dict[str, Any]:
    layers = int(metadata[f"{arch}.block_count"])
    window = int(metadata.get(f"{arch}.attention.sliding_window") or 0)
    pattern = _GEMMA_PATTERN[arch]
    types = [
        "sliding_attention" if window and i % pattern < pattern - 1 else "full_attention"
        for i in range(layers)
    ]
    hidden, heads = int(metadata[f"{arch}.embedding_length"]), int(metadata[f"{arch}.attention.head_count"])
    out: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim,
        "sliding_window": window or None,
        "layer_types": types,
    }
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if metadata.get(f"{arch}.{key}") is not None:
            out[key] = float_value(metadata[f"{arch}.{key}"])
    if arch == "gemma3":
        out["rope_local_base_freq"] = float_value(
            metadata.get("gemma3.rope.freq_base_swa", _GEMMA3_LOCAL_BASE)
        )
        out["sliding_window_pattern"] = pattern
    return out


def float_value(value: float) -> float:
    """A GGUF float32 as the shortest decimal that rounds back to it (1e-05, not 9.999999747378752e-06):
    what HF configs hold, so the model computes identically."""
    return float(str(np.float32(value)))
