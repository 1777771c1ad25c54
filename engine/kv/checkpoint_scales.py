"""Per-layer fp8 KV scales a checkpoint carries (docs/architecture.md#kv-cache-dtype).

vLLM's convention (``BaseKVCacheMethod``): a quantized checkpoint may store
``model.layers.N.self_attn.k_scale`` and ``.v_scale`` (one scalar each, the value of an e4m3 code of 1), or
an older single ``.kv_scale`` for both. ``kv_cache_dtype=fp8`` uses them; without them every scale is 1.0.
The weight loader leaves these tensors alone (``KV_SCALE_SUFFIXES``); only this module reads them.
"""

from __future__ import annotations

import logging
from pathlib import Path

from safetensors import safe_open

log = logging.getLogger(__name__)

#: checkpoint tensor names (after ``model.layers.N.``) that hold KV-cache scales, not weights
KV_SCALE_SUFFIXES = ("self_attn.k_scale", "self_attn.v_scale", "self_attn.kv_scale")


def is_kv_scale(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(KV_SCALE_SUFFIXES)


def read_kv_scales(model_dir: Path, num_layers: int) -> list[tuple[float, float]] | None:
    """``(k_scale, v_scale)`` per layer from ``model_dir``'s safetensors, or None when it has none. A
    checkpoint that scales some layers only, or a scale that is not a positive finite number, is refused."""
    found: dict[str, float] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                if is_kv_scale(name):
                    found[name] = float(handle.get_tensor(name).float().reshape(-1)[0])
    if not found:
        return None
    scales = []
    for i in range(num_layers):
        p = f"model.layers.{i}.self_attn."
        both = found.get(p + "kv_scale")
        k, v = found.get(p + "k_scale", both), found.get(p + "v_scale", both)
        if k is None or v is None:
            raise ValueError(
                f"{model_dir}: the checkpoint has KV scales, but none for layer {i} ({p}k_scale)"
            )
        for label, value in ((p + "k_scale", k), (p + "v_scale", v)):
            if not 0.0 < value < float("inf"):
                raise ValueError(f"{model_dir}: {label} must be a positive finite number, got {value}")
        scales.append((k, v))
    log.info("fp8 KV cache: per-layer k/v scales from the checkpoint")
    return scales
