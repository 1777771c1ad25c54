"""Tensor wrappers of the paged attention kernels (``decode_attention.c``, ``prefill_attention.c``; their
PyTorch references: ``reference.py``), reached as ``NativeOps.attention``.

Both read the K/V blocks of an HND cache in place through int32 block tables (float32 values, or fp8/int8
codes and their scales: ``kv_args``). ``PagedAttentionKernels`` checks the query layout, the GQA group, the
head size, the tables and every block id before calling C, so a kernel never reads outside the cache.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable

import torch

from kvpilot.engine.kv.kv_quant import KVQuant
from kvpilot.engine.native.kv_args import kv_cache_args
from kvpilot.engine.native.tensor_checks import check_contiguous, row_stride

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
_T = ctypes.c_int
#: the KV cache's kind, row scales and per-tensor scales (``kv_args.kv_cache_args``)
KV_ARGS = (_T, _P, _P, _F, _F)
_SIGNATURES = {
    "kvp_paged_decode": (_P, _P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F, _I, _F, *KV_ARGS, _T),
    "kvp_paged_prefill": (_P, _P, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F, _I, _F, *KV_ARGS, _T),
}
#: limits of the attention kernels' per-task buffers
MAX_GROUP = 64
MAX_HEAD_DIM = 256
#: ``paged_prefill`` multiplies 16-column tiles of V, so head_dim must be a multiple of this
PREFILL_HEAD_DIM_MULTIPLE = 16


def _paged_attention_layout(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    head_dim_multiple: int,
) -> tuple[int, int, int]:
    """Checks the attention kernels share (query rows, GQA group, head size, caches, block table dtype and
    layout); returns the query row stride, the query heads and the head size."""
    _, kv_heads, _, head_dim = key_cache.shape
    num_heads = query.shape[1] // head_dim if query.dim() == 2 else 0
    qs = row_stride(query, "query", num_heads * head_dim)
    if (
        not num_heads
        or num_heads % kv_heads
        or num_heads // kv_heads > MAX_GROUP
        or head_dim > MAX_HEAD_DIM
        or head_dim % head_dim_multiple
    ):
        multiple = f"a multiple of {head_dim_multiple} " if head_dim_multiple > 1 else ""
        raise ValueError(
            f"{num_heads} query heads over {kv_heads} KV heads of size {head_dim} "
            f"(group <= {MAX_GROUP}, head_dim {multiple}<= {MAX_HEAD_DIM})"
        )
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be int32 [sequences, max_blocks] with contiguous rows")
    return qs, num_heads, head_dim


def check_block_tables(block_tables: torch.Tensor, longest: int, key_cache: torch.Tensor) -> None:
    """Every sequence fits its table row (``longest`` tokens) and every block id names a cache block."""
    num_blocks, _, block_size, _ = key_cache.shape
    if longest > block_tables.shape[1] * block_size:
        raise ValueError("a sequence is longer than its block table covers")
    if not 0 <= int(block_tables.min()) <= int(block_tables.max()) < num_blocks:
        raise ValueError(f"block ids must lie in [0, {num_blocks})")


class PagedAttentionKernels:
    """``threads`` gives the OpenMP thread count per call (torch's); ``has_avx2`` whether the library
    was built with the prefill kernel's vector path."""

    def __init__(self, lib: ctypes.CDLL, threads: Callable[[], int], has_avx2: bool) -> None:
        self._lib = lib
        self._threads = threads
        for name, argtypes in _SIGNATURES.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = ctypes.c_int  # 0, or -1 when their scratch was not allocated
        #: whether ``paged_prefill`` has its kernel (AVX2; else callers keep their own prefill attention)
        self.has_prefill = has_avx2

    def paged_decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        softcap: float | None = None,
        quant: KVQuant | None = None,
    ) -> torch.Tensor:
        """Attention of each sequence's one new query (``query`` ``[B, Hq * D]`` rows) over its paged
        context, reading K/V blocks in place; returns ``[B, Hq, D]``. ``softcap`` soft-caps the scaled
        scores (``cap * tanh(s / cap)``); ``quant`` says how a quantized cache's codes read."""
        batch = query.shape[0]
        qs, num_heads, head_dim = _paged_attention_layout(query, key_cache, value_cache, block_tables, 1)
        kv = kv_cache_args(key_cache, value_cache, quant)
        _, kv_heads, block_size, _ = key_cache.shape
        check_contiguous(seq_lens, "seq_lens", torch.int32)
        if block_tables.shape[0] < batch or seq_lens.numel() < batch:
            raise ValueError(
                f"{batch} queries but {block_tables.shape[0]} block tables, {seq_lens.numel()} lengths"
            )
        if batch:
            check_block_tables(block_tables[:batch], int(seq_lens[:batch].max()), key_cache)
        out = torch.empty(batch, num_heads, head_dim)
        status = self._lib.kvp_paged_decode(
            out.data_ptr(),
            query.data_ptr(),
            qs,
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            seq_lens.data_ptr(),
            batch,
            num_heads,
            kv_heads,
            head_dim,
            block_size,
            scale,
            sliding_window or 0,
            softcap or 0.0,
            *kv,
            self._threads(),
        )
        if status:
            raise MemoryError("paged_decode could not allocate its row buffers")
        return out

    def paged_prefill(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        softcap: float | None = None,
        quant: KVQuant | None = None,
    ) -> torch.Tensor:
        """Causal attention of prefill/extend tokens over their paged context (their own K/V already
        written): sequence ``s`` owns query rows ``[query_start_loc[s], query_start_loc[s + 1])`` (``query``
        ``[rows, Hq * D]``), the last of its ``seq_lens[s]`` positions, and block table row ``s``. Returns
        ``[query_start_loc[-1] - query_start_loc[0], Hq, D]``; ``softcap`` and ``quant`` as in
        ``paged_decode``. Needs ``has_prefill``."""
        if not self.has_prefill:
            raise ValueError("paged_prefill needs AVX2; keep the PyTorch attention on this CPU")
        qs, num_heads, head_dim = _paged_attention_layout(
            query, key_cache, value_cache, block_tables, PREFILL_HEAD_DIM_MULTIPLE
        )
        kv = kv_cache_args(key_cache, value_cache, quant)
        _, kv_heads, block_size, _ = key_cache.shape
        check_contiguous(query_start_loc, "query_start_loc", torch.int32)
        check_contiguous(seq_lens, "seq_lens", torch.int32)
        seqs = seq_lens.numel()
        if query_start_loc.numel() != seqs + 1 or block_tables.shape[0] != seqs:
            raise ValueError(
                f"{seqs} sequences need {seqs + 1} query offsets and {seqs} block tables, got "
                f"{query_start_loc.numel()} and {block_tables.shape[0]}"
            )
        starts = query_start_loc.tolist()
        q_lens = [b - a for a, b in itertools.pairwise(starts)]
        if seqs and (starts[0] < 0 or starts[-1] > query.shape[0] or min(q_lens) < 0):
            raise ValueError(f"query offsets must rise within the {query.shape[0]} query rows, got {starts}")
        lens = seq_lens.tolist()
        if any(n > length for n, length in zip(q_lens, lens, strict=True)):
            raise ValueError("a sequence has more new tokens than its length")
        if seqs:
            check_block_tables(block_tables, max(lens), key_cache)
        out = torch.empty(starts[-1] - starts[0] if seqs else 0, num_heads, head_dim)
        if seqs:
            status = self._lib.kvp_paged_prefill(
                out.data_ptr(),
                query.data_ptr(),
                qs,
                key_cache.data_ptr(),
                value_cache.data_ptr(),
                block_tables.data_ptr(),
                block_tables.stride(0),
                query_start_loc.data_ptr(),
                seq_lens.data_ptr(),
                seqs,
                num_heads,
                kv_heads,
                head_dim,
                block_size,
                scale,
                sliding_window or 0,
                softcap or 0.0,
                *kv,
                self._threads(),
            )
            if status:
                raise MemoryError("paged_prefill could not allocate its scratch buffers")
        return out
