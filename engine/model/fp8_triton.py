"""Triton GEMM on e4m3 weights with 16/32-bit activations (W8A16): ``y = x Wᵀ (+ b)`` for an
``Fp8Weight`` (``fp8_linear``: e4m3 ``data`` ``[N, K]``, float32 ``scales`` ``[N, G]``, ``block_k`` inputs
per scale), reading one byte per weight instead of the two of a bf16 copy
(docs/architecture.md#fp8-checkpoints).

Each program computes a ``block_m(rows) x BLOCK_N`` tile of y over K in steps of ``BLOCK_K``: it loads the
step's e4m3 bytes, decodes them in registers (sign, 4-bit exponent biased by 7, 3-bit mantissa; the
exponent-0 subnormals and the one NaN code of ``float8_e4m3fn``, no infinities) by integer operations, so
the same code runs in the Triton interpreter, multiplies each weight by its row's scale for its group of
``block_k`` inputs, and accumulates ``tl.dot`` in float32 (IEEE products for float32 x). All dot dimensions
are >= 16 (a tile of fewer rows is masked); offsets are int64.

``fp8_w8a8_linear`` (W8A8, ``activation_quantization='fp8'``) rounds x too: each row to e4m3 with one scale
(``amax / 448``), then ``tl.dot`` multiplies e4m3 tiles by e4m3 tiles into float32 (Hopper's and Ada's fp8
tensor cores; the Triton interpreter computes the same products), each K step times its weight group's scale
and the sum times the row's. It needs K steps inside one scale group (``block_k`` a multiple of
``BLOCK_K``, or one group per row).

``Fp8Linear`` runs them with ``linear_backend='triton'`` (the default on CUDA); their reference is
``fp8_linear.dequantize_fp8`` (and for W8A8 ``quantize_fp8_rows``) then a float64 matmul
(``tests/engine/test_fp8_triton.py``). Import this module only after ``TRITON_INTERPRET`` is decided, as for
the attention kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.engine.model.fp8_linear import FP8_DTYPE, W8A8_K_STEP, w8a8_supported
from kvpilot.engine.model.quant_triton import (
    BLOCK_K,
    BLOCK_N,
    dot_acc,
    launch_tiles,
    output_tile,
    store_tile,
    x_tile,
)


@triton.jit
def _e4m3_to_float(byte):
    """float32 values of e4m3fn codes (uint8): ±(1 + m/8) 2^(e-7), subnormals ±m 2^-9, 0x7f/0xff NaN."""
    b = byte.to(tl.uint32)
    sign, e, m = b >> 7, (b >> 3) & 0xF, b & 0x7
    normal = ((sign << 31) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    subnormal = m.to(tl.float32) * (1.0 / 512.0) * (1.0 - 2.0 * sign.to(tl.float32))
    value = tl.where(e == 0, subnormal, normal)
    return tl.where((e == 15) & (m == 7), float("nan"), value)


@triton.jit
def fp8_linear_kernel(
    x_ptr,
    data_ptr,
    scales_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    num_groups,
    block_k,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    rows, cols, row_ok, col_ok = output_tile(M, N, BM, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK).to(tl.int64)
        k_ok = ks < K
        x = x_tile(x_ptr, rows, ks, stride_xm, row_ok, k_ok)
        w_ok = k_ok[:, None] & col_ok[None, :]
        codes = tl.load(data_ptr + cols[None, :] * K + ks[:, None], mask=w_ok, other=0)
        groups = cols[None, :] * num_groups + (ks // block_k)[:, None]
        scale = tl.load(scales_ptr + groups, mask=w_ok, other=0.0)
        acc = dot_acc(acc, x, _e4m3_to_float(codes) * scale, IEEE)  # weights [BK, BN]
    store_tile(acc, bias_ptr, y_ptr, rows, cols, N, row_ok, col_ok, HAS_BIAS)


def _checked_groups(
    x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, block_k: int, bias: torch.Tensor | None
) -> int:
    """The scale groups per row, once both GEMMs' arguments are checked (see ``fp8_linear``)."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D float32, float16 or bfloat16 with contiguous rows, got {x.dtype}")
    in_features = x.shape[1]
    if data.dtype != FP8_DTYPE or data.dim() != 2 or not data.is_contiguous() or data.shape[1] != in_features:
        raise ValueError(f"data must be contiguous float8_e4m3fn [out, {in_features}], got {data.dtype}")
    out_features = data.shape[0]
    groups = -(-in_features // block_k) if block_k > 0 else 0
    if scales.dtype != torch.float32 or not scales.is_contiguous() or scales.shape != (out_features, groups):
        raise ValueError(f"scales must be contiguous float32 [{out_features}, {groups}] (block_k {block_k})")
    if bias is not None and bias.shape != (out_features,):
        raise ValueError(f"bias must be [{out_features}], got {tuple(bias.shape)}")
    return groups


def fp8_linear(
    x: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    block_k: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``x @ W.T + bias`` in x's dtype (float32, float16 or bfloat16) for W = ``data`` (e4m3 ``[N, K]``) times
    ``scales`` (float32 ``[N, ceil(K / block_k)]``)."""
    groups = _checked_groups(x, data, scales, block_k, bias)
    (rows, in_features), out_features = x.shape, data.shape[0]
    y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows == 0:  # a grid of no programs is not launchable
        return y
    tile_m, grid = launch_tiles(rows, out_features)
    fp8_linear_kernel[grid](
        x,
        data.view(torch.uint8),
        scales,
        scales if bias is None else bias,
        y,
        rows,
        out_features,
        in_features,
        x.stride(0),
        groups,
        block_k,
        HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
        BM=tile_m,
        BN=BLOCK_N,
        BK=BLOCK_K,
    )
    return y


#: the e4m3 format's largest finite value
E4M3_MAX = 448.0
assert BLOCK_K == W8A8_K_STEP  # w8a8_supported's K step is the kernel's


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as e4m3 codes (float8_e4m3fn) and one float32 scale per row: ``x ~ codes * scale``,
    ``scale = amax(|row|) / 448`` (an all-zero row: codes 0)."""
    amax = x.abs().amax(dim=1).float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    codes = (x.float() / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return codes, torch.where(amax > 0, scale, torch.zeros_like(amax))


@triton.jit
def fp8_w8a8_kernel(
    xq_ptr,
    xs_ptr,
    data_ptr,
    scales_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    num_groups,
    block_k,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    rows, cols, row_ok, col_ok = output_tile(M, N, BM, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK).to(tl.int64)
        k_ok = ks < K
        # masked bytes are 0: e4m3's +0
        xq = tl.load(xq_ptr + rows[:, None] * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0)
        wq = tl.load(
            data_ptr + cols[None, :] * K + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0
        )
        part = tl.dot(
            xq.to(tl.float8e4nv, bitcast=True), wq.to(tl.float8e4nv, bitcast=True), out_dtype=tl.float32
        )
        group_scale = tl.load(scales_ptr + cols * num_groups + k0 // block_k, mask=col_ok, other=0.0)
        acc += part * group_scale[None, :]
    acc = acc * tl.load(xs_ptr + rows, mask=row_ok, other=0.0)[:, None]
    store_tile(acc, bias_ptr, y_ptr, rows, cols, N, row_ok, col_ok, HAS_BIAS)


def fp8_w8a8_linear(
    x: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    block_k: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``fp8_linear``'s product with x rounded to e4m3 per row (``quantize_fp8_rows``); same arguments and
    checks, and ``w8a8_supported(block_k, K)``."""
    groups = _checked_groups(x, data, scales, block_k, bias)
    (rows, in_features), out_features = x.shape, data.shape[0]
    if not w8a8_supported(block_k, in_features):
        raise ValueError(
            f"W8A8 scales whole K steps of {BLOCK_K}: scale groups of {block_k} inputs (of {in_features}) "
            "do not fit; use activation_quantization='none' (W8A16)"
        )
    y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    codes, row_scales = quantize_fp8_rows(x)
    tile_m, grid = launch_tiles(rows, out_features)
    fp8_w8a8_kernel[grid](
        codes.view(torch.uint8),
        row_scales,
        data.view(torch.uint8),
        scales,
        scales if bias is None else bias,
        y,
        rows,
        out_features,
        in_features,
        groups,
        block_k,
        HAS_BIAS=bias is not None,
        BM=tile_m,
        BN=BLOCK_N,
        BK=BLOCK_K,
    )
    return y
