"""The RoPE parameters of an HF ``config.json``, in either of its two forms (no torch needed).

transformers < 5 writes ``rope_theta`` and ``rope_scaling``; transformers >= 5 writes one
``rope_parameters`` dict holding ``rope_theta``, ``rope_type`` and the scaling keys (reading a 5.x config
as if it were 4.x silently gives θ = 10000 and no scaling). ``rope_settings`` reads either into
(theta, scaling) with HF 5's defaults filled in, so ``rope.py`` need not know which form it came from.

Models whose layer types rotate differently (Gemma 3: local layers at ``rope_local_base_freq`` without
scaling, global ones at ``rope_theta`` with ``rope_scaling``) are read per ``layer_type``: transformers 5
nests one ``rope_parameters`` dict per layer type, older configs spell the local base as
``rope_local_base_freq`` (docs/models.md).
"""

from __future__ import annotations

from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
#: families whose attention rotates only the first ``partial_rotary_factor`` of each head (HF's Phi3)
PARTIAL_ROTARY_TYPES = ("phi3",)
LAYER_TYPES = ("full_attention", "sliding_attention")
# keys of a ``rope_parameters`` dict that are no scaling parameter
_BASE_KEYS = ("rope_theta", "rope_type", "type")


def rope_settings(
    cfg: dict[str, Any], layer_type: str | None = None
) -> tuple[float, dict[str, Any] | None, int]:
    """(theta, scaling or None, positions the model serves) from an HF ``config.json`` dict, either form,
    for the layers of ``layer_type`` (None: a model whose layers all rotate alike).

    ``scaling`` always carries ``rope_type``; the served length is ``max_position_embeddings``, or the
    original context times ``factor`` for dynamic and YaRN scaling when that is longer (as vLLM serves)."""
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    params = cfg.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ValueError(f"rope_parameters must be an object, got {type(params).__name__}")
        if any(isinstance(v, dict) for v in params.values()):
            if layer_type is None or not isinstance(params.get(layer_type), dict):
                raise ValueError(
                    "rope_parameters per layer type (nested dicts) need the layer's type "
                    f"({' or '.join(LAYER_TYPES)}); got {layer_type!r} for keys {sorted(params)}"
                )
            params = params[layer_type]
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k not in _BASE_KEYS}
        kind = params.get("rope_type", params.get("type", "default"))
    elif layer_type == "sliding_attention" and "rope_local_base_freq" in cfg:
        # Gemma 3 before transformers 5: local layers plain RoPE at their own base, no scaling
        theta, scaling, kind = cfg["rope_local_base_freq"], {}, "default"
    else:
        theta = cfg.get("rope_theta", 10000.0)
        raw = cfg.get("rope_scaling") or {}
        scaling = {k: v for k, v in raw.items() if k not in _BASE_KEYS}
        kind = raw.get("rope_type", raw.get("type", "default")) if raw else "default"
    partial = float(scaling.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0)
    if partial != 1.0 and cfg.get("model_type") not in PARTIAL_ROTARY_TYPES:
        raise ValueError(
            f"partial_rotary_factor {partial} (RoPE on part of each head) is supported for "
            f"{', '.join(PARTIAL_ROTARY_TYPES)} only"
        )
    if kind == "su" or (kind == "yarn" and cfg.get("model_type") == "phi3"):
        kind = "longrope"  # Phi-3's names for LongRoPE (transformers' Phi3Config maps them the same way)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE type {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if kind == "default":
        return float(theta), None, max_pos
    if kind in ("linear", "dynamic", "llama3") and scaling.get("factor") is None:
        raise ValueError(f"RoPE type {kind!r} needs a 'factor'")
    scaling = {"rope_type": kind, **scaling}
    if kind == "dynamic":  # HF and vLLM take the config's max_position_embeddings as the original context
        scaling["original_max_position_embeddings"] = max_pos
    elif kind in ("llama3", "yarn", "longrope"):
        scaling.setdefault(
            "original_max_position_embeddings", cfg.get("original_max_position_embeddings", max_pos)
        )
    if kind == "longrope":
        _check_longrope(scaling, cfg, max_pos, partial)
    served = max_pos
    if kind in ("dynamic", "yarn"):
        factor = scaling.get("factor") or max_pos / float(scaling["original_max_position_embeddings"])
        served = max(max_pos, int(float(scaling["original_max_position_embeddings"]) * float(factor)))
    return float(theta), scaling, served


def rotary_dim(cfg: dict[str, Any], head_dim: int) -> int:
    """The dims of each head RoPE rotates: ``head_dim`` times ``partial_rotary_factor`` (HF's rounding)."""
    params = cfg.get("rope_parameters")
    partial = None
    if isinstance(params, dict) and not any(isinstance(v, dict) for v in params.values()):  # flat
        partial = params.get("partial_rotary_factor")
    partial = partial or cfg.get("partial_rotary_factor")
    return int(head_dim * float(partial or 1.0))


def _check_longrope(scaling: dict[str, Any], cfg: dict[str, Any], max_pos: int, partial: float) -> None:
    """LongRoPE needs one short and one long factor per rotated frequency pair; the magnitude factor
    defaults as HF computes it, from ``max_position_embeddings / original_max_position_embeddings``."""
    heads = int(cfg.get("num_attention_heads") or 1)
    head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size", 2 * heads)) // heads)
    pairs = int(head_dim * partial) // 2
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if not isinstance(factors, list) or len(factors) != pairs:
            raise ValueError(
                f"RoPE type 'longrope' needs {key} as a list of rotated dims / 2 = {pairs} numbers"
            )
    scaling.setdefault("max_position_embeddings", max_pos)
