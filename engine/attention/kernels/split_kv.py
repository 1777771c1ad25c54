"""Split-KV (flash-decoding): how a decode launch splits each sequence's context, and the kernel merging
the splits.

A decode program handles one (sequence, KV head). With few sequences that is too few programs to
fill the GPU, and each one walks the whole context serially; splitting the context into contiguous
ranges multiplies the programs. Each split leaves its normalised partial output and its log-sum-exp
(base 2); the reduction re-weights the partials by ``exp2(lse_s - max lse)``.

The split is chosen per sequence, not per batch (``plan_kv_splits``): the launch's split dimension is
an upper bound, and each sequence cuts its own context into splits of at least ``min_split_tokens``
keys, so a short sequence keeps one program per KV head while a long one in the same batch takes as
many as it needs and does not become the step's tail. The kernel is exact for any plan: a plan only
sizes the work per program, so one fixed plan serves every batch (what a captured decode replays).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvpilot.engine.attention.kernels.launch_math import cdiv, next_power_of_2
from kvpilot.engine.attention.kernels.tile_ops import reduce_max, reduce_sum

#: a split shorter than this costs more in the reduction than it gains in parallelism
MIN_TOKENS_PER_SPLIT = 256
#: enough to fill any current GPU at batch 1; bounds the partial-result scratch
MAX_KV_SPLITS = 16
#: programs per streaming multiprocessor to aim for (two waves hide the tail of uneven sequences)
PROGRAMS_PER_SM = 2


@dataclass(frozen=True)
class SplitPlan:
    #: the launch's split dimension: no sequence uses more splits than this
    num_kv_splits: int
    #: each sequence's splits hold at least this many keys (rounded up to whole tiles by the kernel), so
    #: a sequence uses ``min(num_kv_splits, ceil(its keys / min_split_tokens))`` splits
    min_split_tokens: int


def attended_keys(seq_lens: Sequence[int], sliding_window: int | None) -> list[int]:
    """Keys each decoding sequence attends: its whole context, or the last ``sliding_window`` of it."""
    return [min(n, sliding_window) if sliding_window else n for n in seq_lens]


def plan_kv_splits(active_lens: Sequence[int], num_kv_heads: int, num_sms: int) -> SplitPlan:
    """Splits for one decode launch over sequences attending ``active_lens`` keys each.

    The work per program aims at the batch's total keys × KV heads spread over
    ``PROGRAMS_PER_SM * num_sms`` programs, and never below ``MIN_TOKENS_PER_SPLIT`` keys; each sequence
    takes as many splits of that size as its own context needs (``MAX_KV_SPLITS`` at most). A batch of
    equal sequences that fills the GPU gets no split; one long sequence among short ones is the only
    one split.
    """
    if not active_lens or min(num_kv_heads, num_sms) < 1 or min(active_lens) < 1:
        raise ValueError(
            "a decode launch needs sequences with at least one key, and positive num_kv_heads and num_sms; "
            f"got {len(active_lens)} sequences (shortest {min(active_lens, default=0)}), "
            f"{num_kv_heads} KV heads, {num_sms} SMs"
        )
    total_work = sum(active_lens) * num_kv_heads
    split_tokens = max(MIN_TOKENS_PER_SPLIT, cdiv(total_work, PROGRAMS_PER_SM * num_sms))
    most = max(cdiv(n, split_tokens) for n in active_lens)
    return SplitPlan(max(1, min(most, MAX_KV_SPLITS)), split_tokens)


def plan_for_capture(num_seqs: int, num_kv_heads: int, num_sms: int) -> SplitPlan:
    """The one plan a captured decode of ``num_seqs`` sequences replays, whatever their contexts.

    The host does not see a replayed step's lengths, so the split count is what fills
    ``PROGRAMS_PER_SM * num_sms`` programs when every sequence's context is long (``MAX_KV_SPLITS`` at
    most), and each split holds at least ``MIN_TOKENS_PER_SPLIT`` keys: the kernel, which reads the
    lengths, leaves a short sequence unsplit and gives a long one as many splits as its context fills.
    """
    if min(num_seqs, num_kv_heads, num_sms) < 1:
        raise ValueError(
            f"a captured decode needs positive num_seqs, num_kv_heads and num_sms; got {num_seqs}, "
            f"{num_kv_heads}, {num_sms}"
        )
    splits = cdiv(PROGRAMS_PER_SM * num_sms, num_seqs * num_kv_heads)
    return SplitPlan(max(1, min(splits, MAX_KV_SPLITS)), MIN_TOKENS_PER_SPLIT)


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
        HEAD_DIM_PADDED=next_power_of_2(head_dim),
        SPLITS_PADDED=next_power_of_2(num_kv_splits),
        num_warps=1 if head_dim <= 64 else 2,
    )
