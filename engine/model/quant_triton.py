"""Triton GEMM on quantized weights with 16/32-bit activations (W4A16 / W6A16 / W8A16): ``y = x Wᵀ (+ b)``
reading the very bytes the CPU kernels read (docs/architecture.md#quantized-weights): GGUF Q4_0 / Q4_1 /
Q8_0 blocks, the K-quants Q4_K / Q6_K (256-weight super-blocks, layout in ``native/quant_blocks.h``), or
int8 rows with per-row float32 scales.

Each program computes a ``block_m(rows) x BLOCK_N`` tile of y over K in steps of ``BLOCK_K`` (a multiple
of 32, so a step covers whole blocks, or whole sub-blocks of a super-block): it gathers the step's
quantized bytes, dequantizes them in registers into x's dtype (Q4: the nibble of byte ``j % 16`` chosen
by ``j // 16``; fp16 scales assembled from their two bytes; K-quants: the sub-block's packed scale and
min too) and accumulates ``tl.dot`` in float32 (IEEE products for float32 x). All dot dimensions are
>= 16 (a tile of fewer rows is masked); offsets are int64, since ``rows x row_bytes`` can pass 2^31.
Untuned: one tile shape per row bucket, no split-K for single-row decodes.

``QuantLinear`` runs it with ``linear_backend='triton'`` (the default on CUDA); its reference is
``native.reference.reference_quant_linear`` (K-quants: ``quant_formats.dequantize_k`` then a float64
matmul), held to it in the Triton interpreter (float32 and float16 inputs) and on a GPU alike.
Import this module only after ``TRITON_INTERPRET`` is decided, as for the attention kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.engine.attention.kernels.launch_math import cdiv, next_power_of_2
from kvpilot.engine.native.quant_ops import FORMATS

#: tile sizes: every ``tl.dot`` dimension >= 16; BLOCK_K a multiple of the 32-weight block
BLOCK_N, BLOCK_K = 64, 64
#: most rows of one tile: every row tile dequantizes its columns of W again, so a prefill-sized batch
#: takes 64-row tiles (a quarter of the dequantization 16-row tiles would repeat)
MAX_BLOCK_M = 64


def block_m(rows: int) -> int:
    """Rows per tile: the batch rounded up to a power of two, within [16, ``MAX_BLOCK_M``]."""
    return min(MAX_BLOCK_M, max(16, next_power_of_2(rows)))


def launch_tiles(rows: int, out_features: int) -> tuple[int, tuple[int, int]]:
    """Rows per tile (``block_m``) and the grid (row tiles, column tiles) of a ``rows x out_features`` GEMM:
    what ``output_tile`` reads back in each program."""
    tile_m = block_m(rows)
    return tile_m, (cdiv(rows, tile_m), cdiv(out_features, BLOCK_N))


@triton.jit
def _fp16_at(data_ptr, offsets, mask):
    """The fp16 stored little-endian at byte ``offsets``, as float32."""
    lo = tl.load(data_ptr + offsets, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(data_ptr + offsets + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def output_tile(M, N, BM: tl.constexpr, BN: tl.constexpr):
    """This program's ``BM`` rows and ``BN`` columns of y (int64) and which lie inside ``M`` x ``N``: the
    GEMMs' grids are (row tiles, column tiles)."""
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN).to(tl.int64)
    return rows, cols, rows < M, cols < N


@triton.jit
def x_tile(x_ptr, rows, ks, stride_xm, row_ok, k_ok):
    """The ``[BM, BK]`` tile of x at ``rows`` x ``ks`` (zeros outside ``M`` x ``K``)."""
    return tl.load(
        x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
    )


@triton.jit
def dot_acc(acc, x, w, IEEE: tl.constexpr):
    """``acc + x @ w`` in float32; float32 x multiplies in IEEE float32, not the TF32 a GPU's dot defaults
    to."""
    if IEEE:
        return acc + tl.dot(x, w, input_precision="ieee", out_dtype=tl.float32)
    return acc + tl.dot(x, w.to(x.dtype), out_dtype=tl.float32)


@triton.jit
def store_tile(acc, bias_ptr, y_ptr, rows, cols, N, row_ok, col_ok, HAS_BIAS: tl.constexpr):
    """``acc`` (+ bias) into y's ``rows`` x ``cols``, in y's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows[:, None] * N + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _q4_k_weights(data_ptr, w_row, ks, w_ok):
    """Q4_K weights ``ks`` [BK] of rows ``w_row`` [1, BN] (144-byte super-blocks: fp16 d and dmin, 12 bytes
    of 6-bit sub-block scales and mins, 128 of nibbles): ``d sc_t q - dmin m_t`` for sub-block t."""
    t, j = ((ks % 256) // 32)[:, None], (ks % 32)[:, None]
    start = w_row + ((ks // 256) * 144)[:, None]
    d, dmin = _fp16_at(data_ptr, start, w_ok), _fp16_at(data_ptr, start + 2, w_ok)
    low = t < 4
    # llama.cpp's get_scale_min_k4: s[t], s[t + 4] for t < 4; else also the top bits of s[t - 4], s[t]
    a = tl.load(data_ptr + start + 4 + t, mask=w_ok, other=0).to(tl.int32)
    b = tl.load(data_ptr + start + 8 + t, mask=w_ok, other=0).to(tl.int32)
    c = tl.load(data_ptr + start + tl.where(low, t, t - 4) + 4, mask=w_ok, other=0).to(tl.int32)
    sc = tl.where(low, a & 63, (b & 0xF) | ((c >> 6) << 4)).to(tl.float32)
    m = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4)).to(tl.float32)
    byte = tl.load(data_ptr + start + 16 + 32 * (t // 2) + j, mask=w_ok, other=0).to(tl.int32)
    q = ((byte >> (4 * (t % 2))) & 0xF).to(tl.float32)
    return (d * sc) * q - dmin * m


@triton.jit
def _q6_k_weights(data_ptr, w_row, ks, w_ok):
    """Q6_K weights ``ks`` [BK] of rows ``w_row`` [1, BN] (210-byte super-blocks: 128 bytes of low nibbles,
    64 of high bit pairs, 16 int8 scales of 16 weights each, fp16 d): ``d sc (q - 32)``."""
    t, j = ((ks % 256) // 32)[:, None], (ks % 32)[:, None]
    half, g = t // 4, t % 4
    start = w_row + ((ks // 256) * 210)[:, None]
    lo = tl.load(data_ptr + start + 64 * half + 32 * (g % 2) + j, mask=w_ok, other=0).to(tl.int32)
    hi = tl.load(data_ptr + start + 128 + 32 * half + j, mask=w_ok, other=0).to(tl.int32)
    q = (((lo >> tl.where(g >= 2, 4, 0)) & 0xF) | (((hi >> (2 * g)) & 3) << 4)) - 32
    sc = tl.load(data_ptr + start + 192 + 8 * half + 2 * g + j // 16, mask=w_ok, other=0)
    d = _fp16_at(data_ptr, start + 208, w_ok)
    return (d * sc.to(tl.int8, bitcast=True).to(tl.float32)) * q.to(tl.float32)


@triton.jit
def quant_linear_kernel(
    x_ptr,
    data_ptr,
    scales_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    row_bytes,
    FMT: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
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
        w_row = cols[None, :] * row_bytes  # [1, BN]
        if FMT == 3:  # int8 rows: one signed byte per weight, the row scale applied after the dot
            q = tl.load(data_ptr + w_row + ks[:, None], mask=w_ok, other=0).to(tl.int8, bitcast=True)
            w = q.to(tl.float32)
        elif FMT == 4:
            w = _q4_k_weights(data_ptr, w_row, ks, w_ok)
        elif FMT == 5:
            w = _q6_k_weights(data_ptr, w_row, ks, w_ok)
        else:
            block, j = ks // 32, ks % 32  # [BK]
            start = w_row + (block * BLOCK_BYTES)[:, None]  # [BK, BN]: each weight's block
            d = _fp16_at(data_ptr, start, w_ok)
            if FMT == 2:  # Q8_0: d * q, q a signed byte after the 2-byte scale
                q = tl.load(data_ptr + start + 2 + j[:, None], mask=w_ok, other=0).to(tl.int8, bitcast=True)
                w = d * q.to(tl.float32)
            else:
                header = 4 if FMT == 1 else 2
                byte = tl.load(data_ptr + start + header + (j % 16)[:, None], mask=w_ok, other=0)
                nibble = ((byte >> ((j // 16) * 4).to(tl.uint8)[:, None]) & 0x0F).to(tl.float32)
                if FMT == 1:  # Q4_1: d * q + m
                    w = d * nibble + _fp16_at(data_ptr, start + 2, w_ok)
                else:  # Q4_0: d * (q - 8)
                    w = d * (nibble - 8.0)
        acc = dot_acc(acc, x, w, IEEE)
    if FMT == 3:
        acc *= tl.load(scales_ptr + cols, mask=col_ok, other=0.0)[None, :]
    store_tile(acc, bias_ptr, y_ptr, rows, cols, N, row_ok, col_ok, HAS_BIAS)


def quant_linear(
    x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None, fmt: str, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ W.T + bias`` in x's dtype (float32 or float16/bfloat16), W as ``quant_ops`` describes it."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; the kernels run {sorted(FORMATS)}")
    form = FORMATS[fmt]
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be 2-D float32, float16 or bfloat16, got {x.dtype} {tuple(x.shape)}")
    rows, in_features = x.shape
    out_features = data.shape[0]
    if x.stride(1) != 1 or data.dtype != torch.uint8 or not data.is_contiguous():
        raise ValueError("x needs contiguous rows and data contiguous uint8 [out, row_bytes]")
    if data.shape[1] != form.row_bytes(in_features):
        raise ValueError(f"{fmt} rows of {in_features} inputs are {form.row_bytes(in_features)} bytes")
    if form.row_scales != (scales is not None):
        raise ValueError(f"{fmt} {'needs' if form.row_scales else 'takes no'} row scales")
    y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows == 0:  # a grid of no programs is not launchable
        return y
    tile_m, grid = launch_tiles(rows, out_features)
    quant_linear_kernel[grid](
        x,
        data,
        data if scales is None else scales,
        data if bias is None else bias,
        y,
        rows,
        out_features,
        in_features,
        x.stride(0),
        data.shape[1],
        FMT=form.code,
        BLOCK_BYTES=form.block_bytes,
        HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
        BM=tile_m,
        BN=BLOCK_N,
        BK=BLOCK_K,
    )
    return y
