"""The quantized KV cache's codes in the Triton kernels (docs/architecture.md#kv-cache-dtype), and the
host-side arguments that describe a cache to them. PyTorch reference: ``kvpilot.engine.kv.kv_quant``.

fp8 caches reach the kernels as uint8 views and are decoded and encoded with integer bit operations
(e4m3fn: sign, 4 exponent bits biased by 7, 3 mantissa bits; subnormals are multiples of 2^-9), which run
the same compiled and in the interpreter. Rounding is to nearest, ties to even, as torch's: fp32 ``y +
1.5·2^23 - 1.5·2^23`` rounds ``|y| < 2^22`` to an integer, and a mantissa is rounded by adding
``0x7FFFF + its lowest kept bit`` before the shift. int8 codes, and fp8 codes without checkpoint scales,
carry a float32 scale per (slot, KV head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.engine.kv.kv_quant import KIND_FLOAT, KVQuant

#: float32 1/127 and 1/448 (their exact values), so row scales are ``absmax * (1/127)`` (int8) and
#: ``absmax * (1/448)`` (fp8) as in the reference
INV_INT8_MAX = tl.constexpr(0.007874015718698502)
INV_FP8_MAX = tl.constexpr(0.0022321429569274187)
#: 1.5 * 2^23: adding and subtracting it rounds an fp32 value to an integer, ties to even
ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def round_half_even(y):
    return (y + ROUND_MAGIC) - ROUND_MAGIC


@triton.jit
def fp8_e4m3_to_float(codes):
    """float32 values of uint8 e4m3fn bit patterns."""
    c = codes.to(tl.int32)
    e = (c >> 3) & 15
    m = c & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    magnitude = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((c & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def float_to_fp8_e4m3(y):
    """int32 e4m3fn bit patterns (0..255) of fp32 ``y``, saturated at ±448."""
    sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    subnormal = round_half_even(a * 512.0).to(tl.int32)
    code = tl.where(a < 0.015625, subnormal, normal)
    code = tl.where(a < 448.0, code, 0x7E)
    return code | sign


@triton.jit
def dequantize_tile(raw, row_scales, tensor_scale, KV_KIND: tl.constexpr):
    """float32 values of a loaded tile of codes: fp8 (``KV_KIND`` 1) times the tensor scale, int8 (2) and
    fp8 (3) times each row's scale."""
    if KV_KIND == 1:
        values = fp8_e4m3_to_float(raw) * tensor_scale
    elif KV_KIND == 3:
        values = fp8_e4m3_to_float(raw) * row_scales[:, None]
    else:
        values = raw.to(tl.float32) * row_scales[:, None]
    return values


def kernel_cache_args(
    key_cache: torch.Tensor, value_cache: torch.Tensor, quant: KVQuant | None
) -> tuple[tuple, int]:
    """The positional arguments ``(key cache, value cache, key scales, value scales, scale strides (block,
    slot, head), k_scale, v_scale)`` and the ``KV_KIND`` constexpr the kernels take for these caches."""
    if quant is None:
        dummy = key_cache
        return (key_cache, value_cache, dummy, dummy, 0, 0, 0, 1.0, 1.0), KIND_FLOAT
    if quant.dtype == "fp8":
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
        if quant.key_scales is None:
            return (
                key_cache,
                value_cache,
                key_cache,
                value_cache,
                0,
                0,
                0,
                quant.k_scale,
                quant.v_scale,
            ), quant.kind
    if quant.key_scales is None or quant.value_scales is None:
        raise ValueError(f"an {quant.dtype} KV cache needs its per-row key_scales and value_scales")
    strides = quant.key_scales.stride()
    return (key_cache, value_cache, quant.key_scales, quant.value_scales, *strides, 1.0, 1.0), quant.kind


def compute_dtype(cache_dtype: torch.dtype, query_dtype: torch.dtype, kind: int) -> torch.dtype:
    """The dtype the kernels' dots run in: the cache's for float caches, the query's for codes."""
    return cache_dtype if kind == KIND_FLOAT else query_dtype
