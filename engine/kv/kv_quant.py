"""Low-precision KV cache storage (docs/architecture.md#kv-cache-dtype): what ``kv_cache_dtype`` stores
and the PyTorch reference of its quantization, which every backend's kernels are tested against.

- ``fp8``: ``torch.float8_e4m3fn`` codes ``c = sat(x * (1 / s))`` with one scale per layer for K
  (``k_scale``) and one for V (``v_scale``), vLLM's convention: 1.0 unless the checkpoint carries them.
  e4m3 keeps ~3 significant bits over 2^-9..448, so a per-tensor scale only has to keep values below 448.
- ``int8``: int8 codes ``round(x * (1 / s))`` with ``s = absmax * (1/127)`` per (slot, KV head), stored
  beside the cache as float32 ``cache.shape[:-1]``: int8 is uniform, so a token's scale must follow its
  own range.

Rounding is to nearest, ties to even, everywhere (torch's fp8 conversion, ``torch.round``), so the C and
Triton writers produce the same codes as these functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

#: largest finite float8_e4m3fn; fp8 codes saturate here
FP8_MAX = 448.0
#: int8 codes lie in [-127, 127] (symmetric: -128 is never written)
INT8_MAX = 127.0
#: kernel-side ids of the cache formats (``kv_kind`` in the C and Triton kernels)
KIND_FLOAT, KIND_FP8, KIND_INT8 = 0, 1, 2


@dataclass
class KVQuant:
    """How one layer's K/V codes map back to values."""

    #: ``fp8`` or ``int8``
    dtype: str
    #: fp8: the per-tensor scales of K and V (value = code * scale)
    k_scale: float = 1.0
    v_scale: float = 1.0
    #: int8: float32 scales per (slot, KV head), the cache's shape without its head_dim (None for fp8)
    key_scales: torch.Tensor | None = None
    value_scales: torch.Tensor | None = None

    @property
    def kind(self) -> int:
        return KIND_FP8 if self.dtype == "fp8" else KIND_INT8


class LayerKV(NamedTuple):
    """One layer's cache: K and V tensors and, for a quantized cache, their scales."""

    key: torch.Tensor
    value: torch.Tensor
    quant: KVQuant | None = None


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the cache tensors: the model's dtype for ``auto``."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return torch.float8_e4m3fn
    if kv_cache_dtype == "int8":
        return torch.int8
    raise ValueError(f"kv_cache_dtype must be 'auto', 'fp8' or 'int8', got {kv_cache_dtype!r}")


def scale_bytes_per_element_row(kv_cache_dtype: str) -> int:
    """Bytes stored beside each (slot, KV head) row of K (and of V): int8's float32 scale, else 0."""
    return 4 if kv_cache_dtype == "int8" else 0


def _reciprocal(x: torch.Tensor) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32) / x


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """float8_e4m3fn codes of ``x * (1 / scale)`` (float32 products, as the kernels compute them),
    saturated at ±448."""
    inv = _reciprocal(torch.tensor(scale, dtype=torch.float32))
    return (x.float() * inv.to(x.device)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and float32 scales of the rows of ``x`` (last dim): ``s = absmax * (1/127)``, codes
    ``round(x * (1 / s))`` (0 for an all-zero row, whose scale is 0)."""
    x = x.float()
    inv_max = _reciprocal(torch.tensor(INT8_MAX, dtype=torch.float32)).to(x.device)
    scale = x.abs().amax(dim=-1) * inv_max
    inv = _reciprocal(torch.where(scale > 0, scale, torch.ones_like(scale)))
    codes = torch.round(x * inv.unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def dequantize(codes: torch.Tensor, tensor_scale: float, row_scales: torch.Tensor | None) -> torch.Tensor:
    """float32 values of fp8 codes (times ``tensor_scale``) or int8 codes (times ``row_scales``, the codes'
    shape without the last dim)."""
    if codes.dtype == torch.int8:
        if row_scales is None:
            raise ValueError("int8 KV codes need their per-row scales")
        return codes.float() * row_scales.unsqueeze(-1)
    return codes.float() * tensor_scale


def fp8_e4m3_values() -> torch.Tensor:
    """float32 [256]: the value of every e4m3fn bit pattern (0x7F and 0xFF are NaN); the C kernels' table
    is built from the same bit rule and tested against this."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def quantize_rows(x: torch.Tensor, quant: KVQuant, is_key: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Codes of ``x`` ``[..., head_dim]`` as ``quant`` stores K (``is_key``) or V, and int8's row scales."""
    if quant.dtype == "fp8":
        return quantize_fp8(x, quant.k_scale if is_key else quant.v_scale), None
    return quantize_int8(x)


def dequantize_caches(
    key_cache: torch.Tensor, value_cache: torch.Tensor, quant: KVQuant | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole caches as float32 values (unchanged when ``quant`` is None): what attention over them reads."""
    if quant is None:
        return key_cache, value_cache
    return (
        dequantize(key_cache, quant.k_scale, quant.key_scales),
        dequantize(value_cache, quant.v_scale, quant.value_scales),
    )
