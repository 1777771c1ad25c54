"""Varlen prefill/extend attention: the new tokens of many sequences in one launch.

Sequence ``b`` has ``q_len`` new tokens at positions ``context_len .. seq_len - 1`` (``context_len =
seq_len - q_len`` tokens were cached before this step; all its K/V, new tokens included, are in the
paged cache). New token at position ``i`` attends keys ``j <= i`` (the cached prefix plus a causal
triangle over the new tokens), and with a sliding window ``W`` only ``j > i - W``.

Grid ``(cdiv(max_q_len, TOKENS_PER_PROGRAM), num_seqs, num_kv_heads)``. The M dimension of a program's
tile packs ``TOKENS_PER_PROGRAM = BLOCK_M // QUERY_GROUP`` query tokens times the ``QUERY_GROUP`` query
heads of one KV head (row ``r`` is token ``r // QUERY_GROUP``, head ``r % QUERY_GROUP``), so GQA heads
share every K/V tile load, as in decode. Programs past a sequence's last query tile exit at once, and
key tiles beyond the program's last query position (or before its window) are never loaded.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvpilot.engine.attention.kernels.kv_codes import compute_dtype, kernel_cache_args
from kvpilot.engine.attention.kernels.launch_math import cdiv
from kvpilot.engine.attention.kernels.tile_ops import (
    dot_in_fp32,
    load_kv_tile,
    online_softmax_step,
    padded_dim,
    runs_in_interpreter,
    soft_cap_log2,
    tile_dot,
)
from kvpilot.engine.attention.kernels.tuning import PREFILL_DEFAULT, KernelConfig
from kvpilot.engine.kv.kv_quant import KVQuant


@triton.jit
def paged_prefill_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    key_scales_ptr,
    value_scales_ptr,
    stride_s_block,
    stride_s_slot,
    stride_s_head,
    k_scale,
    v_scale,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    sliding_window,
    softcap,
    stride_q_token,
    stride_q_head,
    stride_q_dim,
    stride_o_token,
    stride_o_head,
    stride_o_dim,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_kc_dim,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    stride_vc_dim,
    stride_bt_seq,
    QUERY_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    KV_KIND: tl.constexpr,
):
    TOKENS_PER_PROGRAM: tl.constexpr = BLOCK_M // QUERY_GROUP
    query_tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    kv_head = tl.program_id(2)

    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    first_token = query_tile * TOKENS_PER_PROGRAM
    if first_token >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    row_token = first_token + rows // QUERY_GROUP
    row_valid = (rows < TOKENS_PER_PROGRAM * QUERY_GROUP) & (row_token < query_len)
    row_pos = context_len + row_token
    heads = (kv_head * QUERY_GROUP + rows % QUERY_GROUP).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM
    row_offsets = (query_start + row_token).to(tl.int64)
    query = tl.load(
        query_ptr
        + row_offsets[:, None] * stride_q_token
        + heads[:, None] * stride_q_head
        + dims[None, :].to(tl.int64) * stride_q_dim,
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    if KV_KIND == 0:  # codes are dequantized to the query's dtype instead
        query = query.to(key_cache_ptr.dtype.element_ty)

    # keys this program can see: up to its last query position; from its first query's window start
    key_end = context_len + tl.minimum(first_token + TOKENS_PER_PROGRAM, query_len)
    key_begin = 0
    if HAS_WINDOW:
        key_begin = (tl.maximum(context_len + first_token - sliding_window + 1, 0) // TILE_N) * TILE_N

    block_table_row = block_tables_ptr + seq * stride_bt_seq
    acc = tl.full((BLOCK_M, HEAD_DIM_PADDED), 0.0, dtype=tl.float32)
    row_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    row_sum = tl.full((BLOCK_M,), 0.0, dtype=tl.float32)
    for tile_start in range(key_begin, key_end, TILE_N):
        token_pos = tile_start + tl.arange(0, TILE_N)
        token_valid = token_pos < key_end
        keys = load_kv_tile(
            key_cache_ptr,
            block_table_row,
            token_pos,
            token_valid,
            kv_head,
            stride_kc_block,
            stride_kc_slot,
            stride_kc_head,
            stride_kc_dim,
            dims,
            dim_valid,
            BLOCK_SIZE,
            key_scales_ptr,
            stride_s_block,
            stride_s_slot,
            stride_s_head,
            k_scale,
            KV_KIND,
        ).to(query.dtype)
        values = load_kv_tile(
            value_cache_ptr,
            block_table_row,
            token_pos,
            token_valid,
            kv_head,
            stride_vc_block,
            stride_vc_slot,
            stride_vc_head,
            stride_vc_dim,
            dims,
            dim_valid,
            BLOCK_SIZE,
            value_scales_ptr,
            stride_s_block,
            stride_s_slot,
            stride_s_head,
            v_scale,
            KV_KIND,
        ).to(query.dtype)
        scores = tile_dot(query, tl.trans(keys), DOT_FP32) * scale_log2
        if HAS_SOFTCAP:
            scores = soft_cap_log2(scores, softcap)
        visible = token_valid[None, :] & (token_pos[None, :] <= row_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (token_pos[None, :] > row_pos[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))
        acc, row_max, row_sum = online_softmax_step(acc, row_max, row_sum, scores, values, DOT_FP32)

    # padded rows may have seen no key; every valid row has seen at least itself
    result = acc / tl.where(row_sum > 0.0, row_sum, 1.0)[:, None]
    tl.store(
        out_ptr
        + row_offsets[:, None] * stride_o_token
        + heads[:, None] * stride_o_head
        + dims[None, :].to(tl.int64) * stride_o_dim,
        result.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dim_valid[None, :],
    )


def paged_prefill(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    config: KernelConfig = PREFILL_DEFAULT,
    softcap: float | None = None,
    quant: KVQuant | None = None,
) -> None:
    """Attention for the new tokens of ``len(seq_lens)`` sequences.

    ``query``/``out`` ``[num_tokens, num_heads, head_dim]`` are indexed through ``query_start_loc``
    (int32 ``[num_seqs + 1]``, absolute offsets into ``query``), so a slice of the step's metadata
    (``query_start_loc[num_decodes:]``, ``seq_lens[num_decodes:]``, ``block_tables[num_decodes:]``)
    attends only the prefill sequences. ``softcap`` and ``quant`` as in ``decode.paged_decode``. Shapes are
    validated by the caller.
    """
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or max_query_len == 0:
        return
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    query_group = num_heads // num_kv_heads
    # a program must hold at least one token with all heads of its group
    block_m = max(config.block_m, padded_dim(query_group))
    tokens_per_program = block_m // query_group

    cache_args, kind = kernel_cache_args(key_cache, value_cache, quant)
    grid = (cdiv(max_query_len, tokens_per_program), num_seqs, num_kv_heads)
    paged_prefill_kernel[grid](
        out,
        query,
        *cache_args,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * math.log2(math.e),
        sliding_window or 0,
        softcap or 0.0,
        *query.stride(),
        *out.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        block_tables.stride(0),
        QUERY_GROUP=query_group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=padded_dim(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        TILE_N=config.tile_n,
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        DOT_FP32=dot_in_fp32(
            compute_dtype(key_cache.dtype, query.dtype, kind), runs_in_interpreter(paged_prefill_kernel)
        ),
        KV_KIND=kind,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
