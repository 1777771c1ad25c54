"""Quantized KV caches for kernel tests: random K/V values stored as fp8 or int8 codes with their scales
(``kvpilot.engine.kv.kv_quant``), in either layout (scales follow the cache's shape without head_dim).
Formats: ``fp8-tensor`` (per-tensor scales, as from a checkpoint), ``fp8`` and ``int8`` (a scale per row).
Importable because ``tests/conftest.py`` puts this folder on ``sys.path``."""

from __future__ import annotations

import torch

from kvpilot.engine.kv.kv_quant import KVQuant, quantize_fp8, quantize_fp8_rows, quantize_int8

#: every quantized format the kernels read and write
FORMATS = ["fp8-tensor", "fp8", "int8"]

#: per-tensor fp8 scales that are not 1, so a kernel that ignores them fails
FP8_K_SCALE, FP8_V_SCALE = 0.05, 0.02


def quantized_caches(
    values_k: torch.Tensor, values_v: torch.Tensor, kv_cache_dtype: str
) -> tuple[torch.Tensor, torch.Tensor, KVQuant]:
    """Codes of the value caches and the ``KVQuant`` that reads them back."""
    if kv_cache_dtype == "fp8-tensor":
        quant = KVQuant("fp8", k_scale=FP8_K_SCALE, v_scale=FP8_V_SCALE)
        return quantize_fp8(values_k, FP8_K_SCALE), quantize_fp8(values_v, FP8_V_SCALE), quant
    rows = quantize_int8 if kv_cache_dtype == "int8" else quantize_fp8_rows
    (kc, ks), (vc, vs) = rows(values_k), rows(values_v)
    return kc, vc, KVQuant(kv_cache_dtype, key_scales=ks, value_scales=vs)


def empty_quantized_caches(
    shape: tuple[int, ...], kv_cache_dtype: str
) -> tuple[torch.Tensor, torch.Tensor, KVQuant]:
    """Zeroed caches (and row scales) of ``shape`` for a write test."""
    dtype = torch.int8 if kv_cache_dtype == "int8" else torch.float8_e4m3fn
    zeros = [torch.zeros(shape, dtype=dtype) for _ in range(2)]
    if kv_cache_dtype == "fp8-tensor":
        return zeros[0], zeros[1], KVQuant("fp8", k_scale=FP8_K_SCALE, v_scale=FP8_V_SCALE)
    scales = [torch.zeros(shape[:-1]) for _ in range(2)]
    return zeros[0], zeros[1], KVQuant(kv_cache_dtype, key_scales=scales[0], value_scales=scales[1])


def clone_quant(quant: KVQuant) -> KVQuant:
    return KVQuant(
        quant.dtype,
        quant.k_scale,
        quant.v_scale,
        None if quant.key_scales is None else quant.key_scales.clone(),
        None if quant.value_scales is None else quant.value_scales.clone(),
    )


def quant_on(quant: KVQuant, device: torch.device) -> KVQuant:
    """``quant`` with its per-row scales (if any) on ``device``."""
    scales = (
        (None, None)
        if quant.key_scales is None
        else (quant.key_scales.to(device), quant.value_scales.to(device))
    )
    return KVQuant(quant.dtype, quant.k_scale, quant.v_scale, *scales)


def spread_values(n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` values spanning e4m3's whole range after fp8 scaling: normals, subnormals, values near a tie
    of two subnormal codes, saturation past 448, zeros and negative zero."""
    wide = torch.randn(n, generator=generator) * torch.exp2(
        torch.randint(-14, 6, (n,), generator=generator).float()
    )
    wide[::7] = 0.0
    wide[1::11] = -0.0
    wide[2::13] = 30.0  # / 0.05 = 600: saturates
    wide[3::17] = 1.5 * 2**-9 * FP8_K_SCALE  # about halfway between two subnormal codes
    return wide
