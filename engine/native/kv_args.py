"""The C kernels' view of a KV cache (``kv_codes.h``'s ``struct kv_view``): checks of the cache tensors and
their scales for ``kv_cache_dtype`` auto/fp8/int8 (docs/architecture.md#kv-cache-dtype), and the trailing
arguments ``kind, k_rows, v_rows, k_scale, v_scale`` the K/V write and the attention kernels take."""

from __future__ import annotations

import torch

from kvpilot.engine.kv.kv_quant import KIND_FLOAT, KVQuant

#: the cache element each kind is stored as
_CACHE_DTYPES = {"auto": torch.float32, "fp8": torch.float8_e4m3fn, "int8": torch.int8}


def _check(x: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if x.dtype != dtype or x.device.type != "cpu" or not x.is_contiguous() or tuple(x.shape) != shape:
        raise ValueError(
            f"{name} must be a contiguous {dtype} CPU tensor of shape {list(shape)}, "
            f"got {x.dtype} {list(x.shape)}"
        )


def kv_cache_args(
    key_cache: torch.Tensor, value_cache: torch.Tensor, quant: KVQuant | None
) -> tuple[int, int | None, int | None, float, float]:
    """``(kind, k_rows pointer, v_rows pointer, k_scale, v_scale)`` for HND caches holding what ``quant``
    says (float32 values when None); raises ``ValueError`` for any other dtype, layout or scale shape."""
    shape = tuple(key_cache.shape)
    kind_name = "auto" if quant is None else quant.dtype
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check(cache, name, _CACHE_DTYPES[kind_name], shape)
    if quant is None:
        return KIND_FLOAT, None, None, 1.0, 1.0
    if quant.dtype == "fp8" and quant.key_scales is None:
        for label, scale in (("k_scale", quant.k_scale), ("v_scale", quant.v_scale)):
            if not 0.0 < scale < float("inf"):
                raise ValueError(f"{label} must be a positive finite number, got {scale}")
        return quant.kind, None, None, quant.k_scale, quant.v_scale
    if quant.key_scales is None or quant.value_scales is None:
        raise ValueError(f"an {quant.dtype} KV cache needs its per-row key_scales and value_scales")
    _check(quant.key_scales, "key_scales", torch.float32, shape[:-1])
    _check(quant.value_scales, "value_scales", torch.float32, shape[:-1])
    return quant.kind, quant.key_scales.data_ptr(), quant.value_scales.data_ptr(), 1.0, 1.0
