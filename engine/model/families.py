"""What each supported dense model family changes in the shared decoder, read from its ``config.json``
(no torch needed). docs/models.md lists the families and the features each needs.

One decoder (``layers``, ``llama``) serves every family; a family is a set of switches on it:

- ``llama`` / ``mistral``: the base (RMSNorm, SwiGLU, GQA); Mistral's window on every layer;
- ``qwen2``: q/k/v biases; ``qwen3``: per-head q/k RMSNorm, no biases; both slide only with
  ``use_sliding_window``, from layer ``max_window_layers`` on;
- ``phi3``: checkpoints with fused ``qkv_proj`` / ``gate_up_proj``, LongRoPE, a window on every layer;
- ``gemma2``: GeGLU, Gemma's ``(1 + w)`` RMSNorm before and after both sublayers, embeddings scaled by
  √hidden, ``query_pre_attn_scalar``, attention-logit and final-logit soft-capping, sliding and global
  layers alternating;
- ``gemma3_text``: Gemma 2's layer plus q/k norm, five local layers per global one, local layers with their
  own RoPE base (``rope_local_base_freq``); soft-capping only when configured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpilot.engine.model.rope_config import LAYER_TYPES

DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
GEMMA_TYPES = ("gemma2", "gemma3_text")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class FamilyTraits:
    """The decoder switches of one family (documented on ``ModelArchConfig``)."""

    hidden_act: str
    layer_types: tuple[str, ...]
    window: int | None
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    gemma_norms: bool
    query_pre_attn_scalar: float | None
    attn_logit_softcap: float | None
    final_logit_softcap: float | None
    fused_checkpoint: bool
    tie_word_embeddings: bool


def family_traits(cfg: dict[str, Any], model_type: str, num_layers: int) -> FamilyTraits:
    gemma = model_type in GEMMA_TYPES
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{model_type}: use_bidirectional_attention (an encoder) cannot serve generation")
    window, layer_types = _windows(cfg, model_type, num_layers)
    attention_bias = bool(cfg.get("attention_bias", model_type == "qwen2"))
    return FamilyTraits(
        hidden_act=act,
        layer_types=layer_types,
        window=window,
        qkv_bias=attention_bias,
        # Qwen2 has bias on q/k/v only; Llama's (and the others') attention_bias covers o_proj too
        o_bias=attention_bias and model_type != "qwen2",
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        gemma_norms=gemma,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256) if gemma else None,
        attn_logit_softcap=_positive(cfg, "attn_logit_softcapping", model_type) if gemma else None,
        final_logit_softcap=_positive(cfg, "final_logit_softcapping", model_type) if gemma else None,
        fused_checkpoint=model_type == "phi3",
        # HF's default when config.json leaves it out: Gemma ties, the others do not
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
    )


def _windows(cfg: dict[str, Any], model_type: str, num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(window size, per-layer type) as HF's config classes default them."""
    window = cfg.get("sliding_window", 4096 if model_type in GEMMA_TYPES else None)
    if model_type == "llama" or (model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window")):
        window = None  # Llama has none; Qwen configs carry a window size but leave it off by default
    window = int(window) if window else None
    given = cfg.get("layer_types")
    if given is not None:
        types = tuple(given)
        if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
            raise ValueError(f"layer_types must list {num_layers} of {LAYER_TYPES}, got {given}")
    elif model_type in ("qwen2", "qwen3"):
        first = int(cfg.get("max_window_layers") or 0)
        types = tuple("sliding_attention" if i >= first else "full_attention" for i in range(num_layers))
    elif model_type in GEMMA_TYPES:
        pattern = (
            2
            if model_type == "gemma2"
            else int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        )
        types = tuple(
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
        )
    else:
        types = ("sliding_attention",) * num_layers
    if window is None:
        types = ("full_attention",) * num_layers
    elif "sliding_attention" in types and window < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens, got {window}")
    return window, types


#: transformers' defaults for soft-caps a config.json leaves out (Gemma2Config; Gemma 3 has none)
_SOFTCAP_DEFAULTS = {"gemma2": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}}


def _positive(cfg: dict[str, Any], key: str, model_type: str) -> float | None:
    value = cfg.get(key, _SOFTCAP_DEFAULTS.get(model_type, {}).get(key))
    if value is None:
        return None
    if float(value) <= 0:
        raise ValueError(f"{key} must be positive or null, got {value}")
    return float(value)
