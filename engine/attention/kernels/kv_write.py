"""KV write: scatter each step's new K/V rows into their paged cache slots.

One program per new token moves all of that token's KV heads (a ``[heads, head_dim]`` tile) for both
K and V, so a token's slot and block address are computed once. Slot ``s`` is row ``s % block_size``
of block ``s // block_size``. Negative slots are padding (e.g. a batch padded to a captured size) and
are skipped.

With ``ROPE`` the same program first applies rotate-half RoPE to the token's query heads and key heads
in place (over each head's first ``2 * half`` dims, the tables' rows at the token's position), then
writes the rotated keys: the layer's RoPE and KV write in one launch, each element read once. Every
value is rotated in float32 and rounded to the activation dtype, as ``fused_triton``'s RoPE kernel does,
before the cache's conversion or quantization.

A quantized cache (``kv_codes``) gets codes: fp8 of ``x * (1 / scale)`` with the layer's per-tensor scale;
int8 (fp8) of ``x * (1 / s)`` with ``s = absmax * (1/127)`` (``* (1/448)``) over each head's row, written
beside the codes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.engine.attention.kernels.kv_codes import (
    INV_FP8_MAX,
    INV_INT8_MAX,
    float_to_fp8_e4m3,
    kernel_cache_args,
    round_half_even,
)
from kvpilot.engine.attention.kernels.launch_math import next_power_of_2
from kvpilot.engine.attention.kernels.tile_ops import reduce_max
from kvpilot.engine.attention.rotation import QKRotation
from kvpilot.engine.kv.kv_quant import KVQuant


@triton.jit
def kv_write_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    key_scales_ptr,
    value_scales_ptr,
    stride_s_block,
    stride_s_slot,
    stride_s_head,
    k_scale,
    v_scale,
    slot_mapping_ptr,
    num_kv_heads,
    stride_k_token,
    stride_k_head,
    stride_k_dim,
    stride_v_token,
    stride_v_head,
    stride_v_dim,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_kc_dim,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    stride_vc_dim,
    query_ptr,
    num_heads,
    stride_q_token,
    stride_q_head,
    stride_q_dim,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_table,
    half,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_KIND: tl.constexpr,
    ROPE: tl.constexpr,
    Q_HEADS_PADDED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PADDED).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PADDED).to(tl.int64)
    mask = (heads < num_kv_heads)[:, None] & (dims < HEAD_DIM)[None, :]
    key_src = key_ptr + token * stride_k_token + heads[:, None] * stride_k_head + dims[None, :] * stride_k_dim
    if ROPE:  # q and k in place first (padding tokens too, as a separate RoPE pass would)
        pos = tl.load(positions_ptr + token).to(tl.int64)
        q_heads = tl.arange(0, Q_HEADS_PADDED).to(tl.int64)
        q_rows = query_ptr + token * stride_q_token + q_heads * stride_q_head
        q_mask = (q_heads < num_heads)[:, None] & (dims < HEAD_DIM)[None, :]
        query = _rotate_half(q_rows, stride_q_dim, dims, q_mask, half, cos_ptr, sin_ptr, pos * stride_table)
        tl.store(
            q_rows[:, None] + dims[None, :] * stride_q_dim, query.to(query_ptr.dtype.element_ty), mask=q_mask
        )
        k_rows = key_ptr + token * stride_k_token + heads * stride_k_head
        key = _rotate_half(k_rows, stride_k_dim, dims, mask, half, cos_ptr, sin_ptr, pos * stride_table)
        key = key.to(key_ptr.dtype.element_ty)
        tl.store(key_src, key, mask=mask)
    else:
        key = tl.load(key_src, mask=mask, other=0.0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    row = slot % BLOCK_SIZE

    value = tl.load(
        value_ptr + token * stride_v_token + heads[:, None] * stride_v_head + dims[None, :] * stride_v_dim,
        mask=mask,
        other=0.0,  # padded lanes join the per-row absmax of int8/fp8 scales: they must be 0
    )
    key_dst = (
        key_cache_ptr
        + block * stride_kc_block
        + row * stride_kc_slot
        + heads[:, None] * stride_kc_head
        + dims[None, :] * stride_kc_dim
    )
    value_dst = (
        value_cache_ptr
        + block * stride_vc_block
        + row * stride_vc_slot
        + heads[:, None] * stride_vc_head
        + dims[None, :] * stride_vc_dim
    )
    if KV_KIND == 0:
        tl.store(key_dst, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(value_dst, value.to(value_cache_ptr.dtype.element_ty), mask=mask)
    elif KV_KIND == 1:
        key_codes = float_to_fp8_e4m3(key.to(tl.float32) * (1.0 / k_scale))
        value_codes = float_to_fp8_e4m3(value.to(tl.float32) * (1.0 / v_scale))
        tl.store(key_dst, key_codes.to(tl.uint8), mask=mask)
        tl.store(value_dst, value_codes.to(tl.uint8), mask=mask)
    else:
        scale_offsets = block * stride_s_block + row * stride_s_slot + heads * stride_s_head
        head_valid = heads < num_kv_heads
        _store_scaled_rows(
            key.to(tl.float32), key_dst, key_scales_ptr + scale_offsets, mask, head_valid, KV_KIND
        )
        _store_scaled_rows(
            value.to(tl.float32), value_dst, value_scales_ptr + scale_offsets, mask, head_valid, KV_KIND
        )


@triton.jit
def _rotate_half(rows, stride_dim, dims, mask, half, cos_ptr, sin_ptr, table_offset):
    """Rotate-half RoPE of the ``[heads, dims]`` tile at ``rows[:, None] + dims * stride_dim`` in float32:
    ``x * cos - partner * sin`` in the first half, ``x * cos + partner * sin`` in the second, where the
    partner is the element ``half`` dims away; dims past ``2 * half`` pass through unchanged."""
    first = dims < half
    rotated = dims < 2 * half
    partner_dims = tl.where(first, dims + half, dims - half)
    x = tl.load(rows[:, None] + dims[None, :] * stride_dim, mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(
        rows[:, None] + partner_dims[None, :] * stride_dim, mask=mask & rotated[None, :], other=0.0
    ).to(tl.float32)
    cos = tl.load(cos_ptr + table_offset + dims, mask=rotated, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + table_offset + dims, mask=rotated, other=0.0).to(tl.float32)
    signed_sin = tl.where(first, -sin, sin)
    return x * cos[None, :] + partner * signed_sin[None, :]


@triton.jit
def _store_scaled_rows(x, dst, scale_dst, mask, head_valid, KV_KIND: tl.constexpr):
    """Codes of each head's row of ``x`` and its scale: int8 (``KV_KIND`` 2) ``absmax * (1/127)``, fp8 (3)
    ``absmax * (1/448)`` (0 for a zero row)."""
    if KV_KIND == 2:
        scale = reduce_max(tl.abs(x), 1) * INV_INT8_MAX
    else:
        scale = reduce_max(tl.abs(x), 1) * INV_FP8_MAX
    inv = 1.0 / tl.where(scale > 0.0, scale, 1.0)
    if KV_KIND == 2:
        codes = round_half_even(x * inv[:, None])
        codes = tl.minimum(tl.maximum(codes, -127.0), 127.0)
        tl.store(dst, codes.to(tl.int8), mask=mask)
    else:
        tl.store(dst, float_to_fp8_e4m3(x * inv[:, None]).to(tl.uint8), mask=mask)
    tl.store(scale_dst, scale, mask=head_valid)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    quant: KVQuant | None = None,
    query: torch.Tensor | None = None,
    rotation: QKRotation | None = None,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into ``[num_blocks, block_size,
    num_kv_heads, head_dim]`` caches at ``slot_mapping`` (int64 ``[num_tokens]``), as ``quant``'s codes
    when given. With ``rotation``, ``query`` ``[num_tokens, num_heads, head_dim]`` and ``key`` are rotated
    in place first and the rotated keys written. Shapes are checked by the caller (the backend validates
    once per step); the rotation's tables here."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_size = key_cache.shape[1]
    if rotation is None:
        rope_args: tuple = (key, 0, 0, 0, 0, slot_mapping, key, key, 0, 0)
        q_heads = 1
    else:
        if query is None:
            raise ValueError("a rotation needs the query it rotates")
        half = rotation.rotary_dim(head_dim, num_tokens) // 2
        q_heads = query.shape[1]
        rope_args = (query, q_heads, *query.stride(), rotation.positions, rotation.cos, rotation.sin)
        rope_args += (rotation.cos.stride(0), half)
    # one program moves every head of a token; more warps once the tile outgrows one warp's registers
    heads = max(num_kv_heads, q_heads)
    tile_elements = next_power_of_2(heads) * next_power_of_2(head_dim)
    num_warps = 1 if tile_elements <= 512 else (4 if tile_elements <= 4096 else 8)
    cache_args, kind = kernel_cache_args(key_cache, value_cache, quant)
    kv_write_kernel[(num_tokens,)](
        key,
        value,
        *cache_args,
        slot_mapping,
        num_kv_heads,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *rope_args,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=next_power_of_2(head_dim),
        HEADS_PADDED=next_power_of_2(num_kv_heads),
        BLOCK_SIZE=block_size,
        KV_KIND=kind,
        ROPE=rotation is not None,
        Q_HEADS_PADDED=next_power_of_2(q_heads),
        num_warps=num_warps,
    )
