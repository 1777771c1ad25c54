"""Split-KV (flash-decoding): how many splits a decode launch uses, and the kernel merging them.

A decode program handles one (sequence, KV head). With few sequences that is too few programs to
fill the GPU, and each one walks the whole context serially; splitting the context into ``S``
contiguous ranges multiplies the programs by ``S``. Each split leaves its normalised partial output and
its log-sum-exp (base 2); the reduction re-weights the partials by ``exp2(lse_s - max lse)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.engine.attention.kernels.tile_ops import reduce_max, reduce_sum

#: a split shorter than this costs more in the reduction than it gains in parallelism
MIN_TOKENS_PER_SPLIT = 256
#: enough to fill any current GPU at batch 1; bounds the partial-result scratch
MAX_KV_SPLITS = 16
#: programs per streaming multiprocessor to aim for (two waves hide the tail of uneven sequences)
PROGRAMS_PER_SM = 2


def choose_num_kv_splits(num_seqs: int, num_kv_heads: int, max_active_len: int, num_sms: int) -> int:
    """Splits per (sequence, KV head) so that the launch has about ``PROGRAMS_PER_SM * num_sms``
    programs, never splitting below ``MIN_TOKENS_PER_SPLIT`` tokens of the longest attended context.

    ``max_active_len`` is the longest number of keys any sequence attends (bounded by a sliding window).
    """
    if min(num_seqs, num_kv_heads, max_active_len, num_sms) < 1:
        raise ValueError(
            "num_seqs, num_kv_heads, max_active_len and num_sms must be positive, got "
            f"{num_seqs}, {num_kv_heads}, {max_active_len}, {num_sms}"
        )
    programs = num_seqs * num_kv_heads
    to_fill_gpu = triton.cdiv(PROGRAMS_PER_SM * num_sms, programs)
    by_length = triton.cdiv(max_active_len, MIN_TOKENS_PER_SPLIT)
    return max(1, min(to_fill_gpu, by_length, MAX_KV_SPLITS))


@triton.jit
def merge_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    num_kv_splits,
    stride_o_token,
    stride_o_head,
    stride_o_dim,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    SPLITS_PADDED: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, SPLITS_PADDED)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    split_valid = splits < num_kv_splits
    dim_valid = dims < HEAD_DIM

    # split 0 always holds the first attended key, so the max is finite; empty splits have lse -inf
    lse = tl.load(
        partial_lse_ptr + seq * stride_pl_seq + head * stride_pl_head + splits,
        mask=split_valid,
        other=float("-inf"),
    )
    weights = tl.exp2(lse - reduce_max(lse, 0))
    partial = tl.load(
        partial_out_ptr
        + seq * stride_po_seq
        + head * stride_po_head
        + splits[:, None].to(tl.int64) * stride_po_split
        + dims[None, :],
        mask=split_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    merged = reduce_sum(partial * weights[:, None], 0) / reduce_sum(weights, 0)
    tl.store(
        out_ptr + seq * stride_o_token + head * stride_o_head + dims * stride_o_dim,
        merged.to(out_ptr.dtype.element_ty),
        mask=dim_valid,
    )


def allocate_partials(
    num_seqs: int, num_heads: int, num_kv_splits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for split results: outputs ``[seqs, heads, splits, head_dim]`` and lse ``[seqs, heads,
    splits]``, both fp32 and contiguous (the kernels index the last dimension with stride 1)."""
    partial_out = torch.empty(
        (num_seqs, num_heads, num_kv_splits, head_dim), dtype=torch.float32, device=device
    )
    partial_lse = torch.empty((num_seqs, num_heads, num_kv_splits), dtype=torch.float32, device=device)
    return partial_out, partial_lse


def merge_splits(out: torch.Tensor, partial_out: torch.Tensor, partial_lse: torch.Tensor) -> None:
    """Merge ``partial_out``/``partial_lse`` of the first ``out.shape[0]`` sequences into ``out``
    ``[num_seqs, num_heads, head_dim]``."""
    num_seqs, num_heads, head_dim = out.shape
    num_kv_splits = partial_out.shape[2]
    merge_splits_kernel[(num_seqs, num_heads)](
        out,
        partial_out,
        partial_lse,
        num_kv_splits,
        *out.stride(),
        *partial_out.stride()[:3],
        *partial_lse.stride()[:2],
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
        SPLITS_PADDED=triton.next_power_of_2(num_kv_splits),
        num_warps=1 if head_dim <= 64 else 2,
    )
