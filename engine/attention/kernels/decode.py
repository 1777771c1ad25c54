"""Paged decode attention: one new query token per sequence, over its paged K/V context.

Grid ``(num_seqs, num_kv_heads, num_kv_splits)``. A program owns one KV head of one sequence and all
``QUERY_GROUP`` query heads that share it (GQA): the group is the M dimension of the score dot
(padded to 16 for ``tl.dot``), so every K/V tile is loaded once per group instead of once per query
head. The context is walked in ``TILE_N``-key tiles with an online softmax. With ``num_kv_splits > 1``
the attended key range is cut into contiguous tile-aligned ranges of at least ``min_split_tokens`` keys,
one per split (a short sequence leaves the later splits empty), whose normalised
outputs and log-sum-exps go to scratch for ``split_kv.merge_splits``; with one split the program writes
the final output directly and no reduction is launched.

The query is at position ``seq_len - 1``: every cached key is causal-visible, and a sliding window of
``W`` keeps keys ``j >= seq_len - W`` (tiles wholly before the window are never loaded).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvpilot.engine.attention.kernels.kv_codes import compute_dtype, kernel_cache_args
from kvpilot.engine.attention.kernels.split_kv import merge_splits
from kvpilot.engine.attention.kernels.tile_ops import (
    ceil_div,
    dot_in_fp32,
    load_kv_tile,
    online_softmax_step,
    padded_dim,
    runs_in_interpreter,
    soft_cap_log2,
    tile_dot,
)
from kvpilot.engine.attention.kernels.tuning import DECODE_DEFAULT, KernelConfig
from kvpilot.engine.kv.kv_quant import KVQuant


@triton.jit
def paged_decode_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
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
    scale_log2,
    sliding_window,
    softcap,
    num_kv_splits,
    min_split_tokens,
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
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    QUERY_GROUP: tl.constexpr,
    GROUP_PADDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    WRITE_PARTIALS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    KV_KIND: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    first_key = 0
    if HAS_WINDOW:
        first_key = tl.maximum(seq_len - sliding_window, 0)
    # tiles are aligned to TILE_N from the first attended tile, so split 0 always holds first_key
    range_start = (first_key // TILE_N) * TILE_N
    num_tiles = ceil_div(seq_len - range_start, TILE_N)
    # this sequence's own split size: its tiles over the launch's splits, but no fewer keys than the plan's
    # minimum, so a short sequence leaves the later splits empty instead of cutting its context thin
    tiles_per_split = tl.maximum(ceil_div(num_tiles, num_kv_splits), ceil_div(min_split_tokens, TILE_N))
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    group_rows = tl.arange(0, GROUP_PADDED)
    row_valid = group_rows < QUERY_GROUP
    heads = (kv_head * QUERY_GROUP + group_rows).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM
    query = tl.load(
        query_ptr
        + seq * stride_q_token
        + heads[:, None] * stride_q_head
        + dims[None, :].to(tl.int64) * stride_q_dim,
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    if KV_KIND == 0:  # codes are dequantized to the query's dtype instead
        query = query.to(key_cache_ptr.dtype.element_ty)

    block_table_row = block_tables_ptr + seq * stride_bt_seq
    acc = tl.full((GROUP_PADDED, HEAD_DIM_PADDED), 0.0, dtype=tl.float32)
    row_max = tl.full((GROUP_PADDED,), float("-inf"), dtype=tl.float32)
    row_sum = tl.full((GROUP_PADDED,), 0.0, dtype=tl.float32)
    for tile in range(tile_begin, tile_end):
        token_pos = range_start + tile * TILE_N + tl.arange(0, TILE_N)
        token_valid = (token_pos < seq_len) & (token_pos >= first_key)
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
        scores = tl.where(token_valid[None, :], scores, float("-inf"))
        acc, row_max, row_sum = online_softmax_step(acc, row_max, row_sum, scores, values, DOT_FP32)

    # an empty split (more splits than tiles) has row_sum 0: output 0 and lse -inf (weight 0 when merged)
    safe_sum = tl.where(row_sum > 0.0, row_sum, 1.0)
    result = acc / safe_sum[:, None]
    store_mask = row_valid[:, None] & dim_valid[None, :]
    if WRITE_PARTIALS:
        lse = tl.where(row_sum > 0.0, row_max + tl.log2(safe_sum), float("-inf"))
        tl.store(partial_lse_ptr + seq * stride_pl_seq + heads * stride_pl_head + split, lse, mask=row_valid)
        tl.store(
            partial_out_ptr
            + seq * stride_po_seq
            + heads[:, None] * stride_po_head
            + split.to(tl.int64) * stride_po_split
            + dims[None, :],
            result,
            mask=store_mask,
        )
    else:
        tl.store(
            out_ptr
            + seq * stride_o_token
            + heads[:, None] * stride_o_head
            + dims[None, :].to(tl.int64) * stride_o_dim,
            result.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )


def paged_decode(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_kv_splits: int = 1,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: KernelConfig = DECODE_DEFAULT,
    softcap: float | None = None,
    quant: KVQuant | None = None,
    min_split_tokens: int = 1,
) -> None:
    """Decode attention for ``query`` ``[num_seqs, num_heads, head_dim]`` (token ``b`` is sequence
    ``b``'s only new token) into ``out`` of the same shape.

    ``block_tables`` int32 ``[>= num_seqs, max_blocks]`` and ``seq_lens`` int32 ``[>= num_seqs]`` may be
    the whole step's tensors: only their first ``num_seqs`` rows are read. With ``num_kv_splits > 1``,
    ``partials`` is the scratch from ``split_kv.allocate_partials`` (at least ``num_seqs`` rows), and each
    sequence's splits hold at least ``min_split_tokens`` keys (``split_kv.SplitPlan``; 1: every sequence
    spreads its context over all the splits).
    ``softcap`` soft-caps the scaled scores (``cap * tanh(s / cap)``, Gemma 2). Shapes are validated by the
    caller.
    """
    num_seqs, num_heads, head_dim = query.shape
    if num_seqs == 0:
        return
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    query_group = num_heads // num_kv_heads
    write_partials = num_kv_splits > 1
    if write_partials:
        if partials is None or partials[0].shape[2] != num_kv_splits or partials[0].shape[0] < num_seqs:
            raise ValueError(
                f"num_kv_splits={num_kv_splits} needs scratch from allocate_partials with "
                f">= {num_seqs} sequences and exactly {num_kv_splits} splits"
            )
        partial_out, partial_lse = partials
    else:
        # never written; any tensor satisfies the pointer arguments
        partial_out, partial_lse = out, out
    partial_strides = (*partial_out.stride()[:3], *partial_lse.stride()[:2]) if write_partials else (0,) * 5

    cache_args, kind = kernel_cache_args(key_cache, value_cache, quant)
    paged_decode_kernel[(num_seqs, num_kv_heads, num_kv_splits)](
        out,
        partial_out,
        partial_lse,
        query,
        *cache_args,
        block_tables,
        seq_lens,
        scale * math.log2(math.e),
        sliding_window or 0,
        softcap or 0.0,
        num_kv_splits,
        min_split_tokens,
        *query.stride(),
        *out.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        block_tables.stride(0),
        *partial_strides,
        QUERY_GROUP=query_group,
        GROUP_PADDED=padded_dim(query_group),
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=padded_dim(head_dim),
        BLOCK_SIZE=block_size,
        TILE_N=config.tile_n,
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        WRITE_PARTIALS=write_partials,
        DOT_FP32=dot_in_fp32(
            compute_dtype(key_cache.dtype, query.dtype, kind), runs_in_interpreter(paged_decode_kernel)
        ),
        KV_KIND=kind,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if write_partials:
        merge_splits(out, partial_out, partial_lse)
