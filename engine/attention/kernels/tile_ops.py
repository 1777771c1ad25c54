"""Device functions shared by the paged decode and prefill kernels, and the host-side facts they need.

Both attention kernels walk a sequence's logical token positions in tiles of ``TILE_N`` keys. A tile
may span several cache blocks or part of one, so K/V rows are gathered per token through the block
table instead of assuming tile == block: the tile size stays a tuning knob independent of the
engine's block size. Address arithmetic is int64 because ``block_id * block_stride`` overflows int32
for caches beyond 2^31 elements (a few GiB).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kvpilot.engine.attention.kernels.kv_codes import dequantize_tile
from kvpilot.engine.attention.kernels.launch_math import next_power_of_2

#: cache dtypes the kernels accept: values, or the codes of ``kv_cache_dtype`` fp8/int8 (``kv_codes``)
SUPPORTED_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8)
#: tl.dot needs every dimension >= 16
MIN_DOT_DIM = 16


def padded_dim(n: int) -> int:
    """The power of two >= max(n, 16) a tile dimension of extent ``n`` is padded to (masked beyond n)."""
    return max(MIN_DOT_DIM, next_power_of_2(n))


def runs_in_interpreter(kernel: object) -> bool:
    """True when ``kernel`` was created under TRITON_INTERPRET=1 (it then runs in Python on the host)."""
    return isinstance(kernel, InterpretedFunction)


def dot_in_fp32(cache_dtype: torch.dtype, interpreted: bool) -> bool:
    """Whether the kernels upcast dot operands to fp32 (and ask for IEEE fp32 products).

    fp32 caches: always, so GPUs do not silently round to TF32 and fp32 results match a fp32
    reference. bf16 caches: only in the interpreter, whose numpy dot stores bf16 as raw uint16 and
    computes garbage; on GPUs bf16 goes to the tensor cores like fp16.
    """
    return cache_dtype == torch.float32 or (interpreted and cache_dtype == torch.bfloat16)


# tl.zeros, tl.cdiv, tl.max and tl.sum are themselves @triton.jit functions, created when triton is first
# imported. If that import happened before TRITON_INTERPRET=1 was set (transformers and torch._dynamo
# import triton), they are compiler-only objects the interpreter cannot call, and every kernel using them
# fails on CPU. The kernels therefore use builtins only: tl.full, integer arithmetic, and tl.reduce with
# the same combine functions tl.max/tl.sum use (which the interpreter also runs with numpy).


@triton.jit
def ceil_div(a, b):
    return (a + b - 1) // b


@triton.jit
def reduce_max(x, axis: tl.constexpr):
    """``tl.max(x, axis)`` for fp32 ``x``."""
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def reduce_sum(x, axis: tl.constexpr):
    """``tl.sum(x, axis)`` for fp32 ``x``."""
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def load_kv_tile(
    cache_ptr,
    block_table_row_ptr,
    token_pos,
    token_valid,
    kv_head,
    stride_block,
    stride_slot,
    stride_head,
    stride_dim,
    dim_offsets,
    dim_valid,
    BLOCK_SIZE: tl.constexpr,
    scales_ptr,
    stride_s_block,
    stride_s_slot,
    stride_s_head,
    tensor_scale,
    KV_KIND: tl.constexpr,
):
    """Gather the ``[TILE_N, HEAD_DIM_PADDED]`` K or V rows of one KV head at logical ``token_pos``: the
    cache's values, or for codes (``KV_KIND`` 1 fp8, 2 int8, 3 fp8 with row scales) their float32
    dequantization with the tensor scale or the rows' scales at ``scales_ptr``.

    Invalid tokens and padded dims read 0; their scores are masked by the caller.
    """
    physical_block = tl.load(block_table_row_ptr + token_pos // BLOCK_SIZE, mask=token_valid, other=0)
    slot = (token_pos % BLOCK_SIZE).to(tl.int64)
    row_offset = (
        physical_block.to(tl.int64) * stride_block + slot * stride_slot + kv_head.to(tl.int64) * stride_head
    )
    ptrs = cache_ptr + row_offset[:, None] + dim_offsets.to(tl.int64)[None, :] * stride_dim
    raw = tl.load(ptrs, mask=token_valid[:, None] & dim_valid[None, :], other=0)
    if KV_KIND == 0:
        tile = raw
    else:
        row_scales = tl.full((raw.shape[0],), 0.0, dtype=tl.float32)
        if KV_KIND >= 2:
            scale_offset = (
                physical_block.to(tl.int64) * stride_s_block
                + slot * stride_s_slot
                + kv_head.to(tl.int64) * stride_s_head
            )
            row_scales = tl.load(scales_ptr + scale_offset, mask=token_valid, other=0.0)
        tile = dequantize_tile(raw, row_scales, tensor_scale, KV_KIND)
    return tile


@triton.jit
def tile_dot(a, b, DOT_FP32: tl.constexpr):
    """``a @ b`` accumulated in fp32; see ``dot_in_fp32`` for when operands are upcast."""
    if DOT_FP32:
        result = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        result = tl.dot(a.to(b.dtype), b)
    return result


@triton.jit
def soft_cap_log2(scores_log2, softcap):
    """Gemma 2's soft-capping on scores in log2 units (``s * log2(e)``): ``cap * tanh(s / cap) * log2(e)``.
    tanh(x) = 1 - 2 / (exp(2x) + 1), which saturates to ±1 without overflow (Triton has no portable
    tanh); its rounding near 0 is ~1e-7 absolute, times the cap."""
    two_x_log2 = scores_log2 * (2.0 / softcap)  # 2 s / cap, times log2(e)
    tanh = 1.0 - 2.0 / (tl.exp2(two_x_log2) + 1.0)
    return tanh * (softcap * 1.4426950408889634)


@triton.jit
def online_softmax_step(acc, row_max, row_sum, scores, values, DOT_FP32: tl.constexpr):
    """Fold one tile into the running softmax state (base-2: ``scores`` are pre-scaled by log2(e)).

    Masked scores are -inf. A row that has seen only masked keys keeps max -inf; using 0 as its
    reference keeps exp2 finite (exp2(-inf) = 0) instead of producing inf - inf = NaN.
    """
    new_max = tl.maximum(row_max, reduce_max(scores, 1))
    reference = tl.where(new_max == float("-inf"), 0.0, new_max)
    probs = tl.exp2(scores - reference[:, None])
    correction = tl.exp2(row_max - reference)
    row_sum = row_sum * correction + reduce_sum(probs, 1)
    acc = acc * correction[:, None] + tile_dot(probs, values, DOT_FP32)
    return acc, new_max, row_sum
