"""Low-precision KV cache storage (docs/architecture.md#kv-cache-dtype): what ``kv_cache_dtype`` stores
and the PyTorch reference of its quantization, which every backend's kernels are tested against.

- ``fp8``: ``torch.float8_e4m3fn`` codes ``c = sat(x * (1 / s))``. With the checkpoint's per-layer
  ``k_scale``/``v_scale`` (vLLM's convention), ``s`` is that scale; without them, ``s = absmax * (1/448)``
  per (slot, KV head), stored like int8's: vLLM's default of 1.0 leaves 41% of SmolLM2's V values in
  e4m3's subnormal range (below 2^-6, fewer than 3 significant bits) and costs +1.4% perplexity against
  +0.6% for int8 (bench/results/kv_cache_dtype.md).
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
#: kernel-side ids of the cache formats (``kv_kind`` in the C and Triton kernels): fp8 with per-tensor
#: scales, int8 and fp8 with per-row scales
KIND_FLOAT, KIND_FP8, KIND_INT8, KIND_FP8_ROWS = 0, 1, 2, 3


@dataclass
class KVQuant:
    """How one layer's K/V codes map back to values."""

    #: ``fp8`` or ``int8``
    dtype: str
    #: fp8 without row scales: the per-tensor scales of K and V (value = code * scale)
    k_scale: float = 1.0
    v_scale: float = 1.0
    #: int8, and fp8 without checkpoint scales: float32 scales per (slot, KV head), the cache's shape
    #: without its head_dim
    key_scales: torch.Tensor | None = None
    value_scales: torch.Tensor | None = None

    @property
    def kind(self) -> int:
        if self.dtype == "int8":
            return KIND_INT8
        return KIND_FP8 if self.key_scales is None else KIND_FP8_ROWS


class LayerKV(NamedTuple):
    """One layer's cache: K and V tensors and, for a quantized cache, their scales."""

    key: torch.Tensor
    value: torch.Tensor
    quant: KVQuant | None = None


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a uint8 view of an fp8 tensor (the same bytes): PyTorch lacks fp8 ``index_copy`` on
    CPU and fp8 indexing kernels on some devices, while byte copies move codes exactly."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the cache tensors: the model's dtype for ``auto``."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return torch.float8_e4m3fn
    if kv_cache_dtype == "int8":
        return torch.int8
    raise ValueError(f"kv_cache_dtype must be 'auto', 'fp8' or 'int8', got {kv_cache_dtype!r}")


def scale_bytes_per_element_row(kv_cache_dtype: str, tensor_scales: bool = False) -> int:
    """Bytes stored beside each (slot, KV head) row of K (and of V): the float32 scale of int8, and of fp8
    unless it has per-tensor (checkpoint) scales; 0 for a float cache."""
    if kv_cache_dtype == "int8" or (kv_cache_dtype == "fp8" and not tensor_scales):
        return 4
    return 0


def _reciprocal(x: torch.Tensor) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32) / x


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """float8_e4m3fn codes of ``x * (1 / scale)`` (float32 products, as the kernels compute them),
    saturated at ±448."""
    inv = _reciprocal(torch.tensor(scale, dtype=torch.float32))
    return (x.float() * inv.to(x.device)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _row_scales(x: torch.Tensor, code_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = absmax * (1 / code_max)`` per row of float32 ``x``, and ``1 / s`` (1 for a zero row)."""
    inv_max = _reciprocal(torch.tensor(code_max, dtype=torch.float32)).to(x.device)
    scale = x.abs().amax(dim=-1) * inv_max
    return scale, _reciprocal(torch.where(scale > 0, scale, torch.ones_like(scale)))


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and float32 scales of the rows of ``x`` (last dim): ``s = absmax * (1/127)``, codes
    ``round(x * (1 / s))`` (0 for an all-zero row, whose scale is 0)."""
    x = x.float()
    scale, inv = _row_scales(x, INT8_MAX)
    codes = torch.round(x * inv.unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn codes and float32 scales of the rows of ``x``: ``s = absmax * (1/448)``, codes of
    ``x * (1 / s)`` (the row's largest value maps to 448)."""
    x = x.float()
    scale, inv = _row_scales(x, FP8_MAX)
    return (x * inv.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantize(codes: torch.Tensor, tensor_scale: float, row_scales: torch.Tensor | None) -> torch.Tensor:
    """float32 values of codes: times ``row_scales`` (the codes' shape without the last dim) when given,
    else (fp8 only) times ``tensor_scale``."""
    if row_scales is not None:
        return codes.float() * row_scales.unsqueeze(-1)
    if codes.dtype == torch.int8:
        raise ValueError("int8 KV codes need their per-row scales")
    return codes.float() * tensor_scale


def fp8_e4m3_values() -> torch.Tensor:
    """float32 [256]: the value of every e4m3fn bit pattern (0x7F and 0xFF are NaN); the C kernels' table
    is built from the same bit rule and tested against this."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def quantize_rows(x: torch.Tensor, quant: KVQuant, is_key: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Codes of ``x`` ``[..., head_dim]`` as ``quant`` stores K (``is_key``) or V, and int8's row scales."""
    if quant.dtype == "int8":
        return quantize_int8(x)
    if quant.key_scales is not None:
        return quantize_fp8_rows(x)
    return quantize_fp8(x, quant.k_scale if is_key else quant.v_scale), None


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
