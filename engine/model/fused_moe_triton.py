"""The fused-MoE Triton kernel: routed experts as two grouped GEMMs over tokens sorted by expert
(docs/architecture.md#mixture-of-experts), in the style of vLLM's ``fused_moe``.

``align_block_size`` sorts the ``T * k`` (token, expert) assignments by expert and pads each expert's
run to a multiple of ``BLOCK_M`` with a sentinel (``T * k``), so every ``BLOCK_M`` rows of the sorted list
belong to one expert; ``block_experts[b]`` names it. An expert no token chose gets no block. All of it is
device ops with a worst-case size (``T*k + E*(BLOCK_M-1)`` rows): no host sync, and programs past the
real padded length (read from a device scalar) return at once.

``moe_gemm_kernel``: program (m, n) computes a ``BLOCK_M x BLOCK_N`` tile (``tile_sizes``: 16-row blocks
for decode-sized calls, 64 x 64 tiles once experts average more than 16 rows) for one block of sorted rows
against that block's expert: rows of A are gathered by sorted id (``id // TOP_K`` for the first GEMM,
whose A is the token's hidden state; ``id`` itself for the second), the tile is written to the
assignment's own row of C, sentinel rows masked. The second GEMM multiplies in the routing weight.
``tl.dot`` dimensions are all >= 16; offsets are int64 (``rows x stride`` passes 2^31 for large batches
of wide experts).

Import this module only after ``TRITON_INTERPRET`` is decided, as for the attention kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvpilot.engine.attention.kernels.launch_math import cdiv

#: tile sizes of a decode-sized call: every ``tl.dot`` dimension >= 16
BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32
#: tiles once experts average more rows than a 16-row block: more reuse of each weight tile loaded
LARGE_TILES = (64, 64, 32)


def tile_sizes(assignments: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for ``assignments`` rows over ``num_experts``: 16-row blocks while the
    average expert has at most 16 rows (a bigger block would be mostly padding), 64 x 64 tiles beyond
    (vLLM's untuned defaults make the same switch). Chosen from shapes only, so no host sync."""
    return (BLOCK_M, BLOCK_N, BLOCK_K) if assignments <= BLOCK_M * num_experts else LARGE_TILES


def align_block_size(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted assignment ids int64 ``[P]``, expert of each ``block_m`` block int64 ``[P / block_m]``,
    real padded length int64 ``[1]``), ``P`` the worst case; padding ids are ``ids.numel()``."""
    flat = ids.reshape(-1)
    assignments = flat.numel()
    max_padded = cdiv(assignments + num_experts * (block_m - 1), block_m) * block_m
    # scatter_add, not bincount: bincount's output size depends on the data, a host sync on a GPU
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    experts_sorted = flat[order]
    first = torch.cumsum(counts, 0) - counts  # where each expert's run starts among the sorted ids
    rank = torch.arange(assignments, device=ids.device) - first[experts_sorted]
    sorted_ids = torch.full((max_padded,), assignments, dtype=torch.int64, device=ids.device)
    sorted_ids[ends[experts_sorted] - padded[experts_sorted] + rank] = order
    block_starts = torch.arange(0, max_padded, block_m, device=ids.device)
    block_experts = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_experts, ends[-1:]


@triton.jit
def moe_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weights_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    num_padded_ptr,
    N,
    K,
    num_valid,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    TOP_K: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BM >= tl.load(num_padded_ptr):
        return
    ids = tl.load(sorted_ids_ptr + pid_m.to(tl.int64) * BM + tl.arange(0, BM).to(tl.int64))
    valid = ids < num_valid
    rows = ids // TOP_K
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    cols = pid_n.to(tl.int64) * BN + tl.arange(0, BN).to(tl.int64)
    col_ok = cols < N
    b_base = b_ptr + expert * stride_be + cols[None, :] * stride_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK).to(tl.int64)
        k_ok = ks < K
        a = tl.load(
            a_ptr + rows[:, None] * stride_am + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0
        )
        b = tl.load(b_base + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BK, BN]
        acc += tl.dot(a, b, out_dtype=tl.float32)
    if MUL_WEIGHT:
        acc *= tl.load(weights_ptr + ids, mask=valid, other=0.0)[:, None]
    out = c_ptr + ids[:, None] * stride_cm + cols[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


def _gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    weights: torch.Tensor,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    tiles: tuple[int, int, int],
    num_valid: int,
    top_k: int,
    mul_weight: bool,
) -> None:
    sorted_ids, block_experts, num_padded = align
    n_out, k_in = b.shape[1], b.shape[2]
    grid = (block_experts.numel(), cdiv(n_out, tiles[1]))
    moe_gemm_kernel[grid](
        a,
        b,
        c,
        weights,
        sorted_ids,
        block_experts,
        num_padded,
        n_out,
        k_in,
        num_valid,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        TOP_K=top_k,
        MUL_WEIGHT=mul_weight,
        BM=tiles[0],
        BN=tiles[1],
        BK=tiles[2],
    )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    tiles: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` in x's dtype (``moe_experts`` describes the operands);
    ``tiles`` overrides ``tile_sizes``."""
    tokens, top_k = ids.shape
    experts, two_inter, hidden = w13.shape
    if x.shape[1] != hidden or tuple(w2.shape) != (experts, hidden, two_inter // 2):
        raise ValueError(f"expert weights w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit x")
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs contiguous rows")
    assignments = tokens * top_k
    tiles = tiles or tile_sizes(assignments, experts)
    if min(tiles) < 16:
        raise ValueError(f"tile sizes {tiles}: every tl.dot dimension must be >= 16")
    align = align_block_size(ids, experts, tiles[0])
    flat_weights = weights.reshape(-1).float().contiguous()
    gate_up = torch.empty(assignments, two_inter, dtype=x.dtype, device=x.device)
    _gemm(x, w13, gate_up, flat_weights, align, tiles, assignments, top_k, mul_weight=False)
    inter = two_inter // 2
    act = (F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()).to(x.dtype)
    down = torch.empty(assignments, hidden, dtype=x.dtype, device=x.device)
    _gemm(act, w2, down, flat_weights, align, tiles, assignments, 1, mul_weight=True)
    return down.view(tokens, top_k, hidden).sum(1)
