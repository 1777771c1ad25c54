"""Host-side checks of what the Triton attention kernels are handed (no device sync): the step's layout,
one layer's caches, and the rows of q/k/v. The kernels index raw pointers, so a wrong shape, dtype or
stride would read or write the wrong memory rather than fail; these turn it into a ``ValueError``.
"""

from __future__ import annotations

import torch

from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.engine.kv.kv_quant import KVQuant


def check_rows(
    label: str, tensor: torch.Tensor | None, dims: str, expected: tuple[int, ...], device: torch.device
) -> None:
    """``tensor`` has the ``expected`` shape (named ``dims``) and lives on ``device`` (the caches')."""
    if tensor is None or tuple(tensor.shape) != expected:
        got = None if tensor is None else list(tensor.shape)
        raise ValueError(f"{label} must be [{dims}] = {list(expected)}, got {got}")
    if tensor.device != device:
        raise ValueError(f"{label} is on {tensor.device} but the cache is on {device}")


def check_caches(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    supported: tuple[torch.dtype, ...],
    quant: KVQuant | None,
) -> None:
    """One layer's caches: ``[num_blocks, block_size, num_kv_heads, head_dim]`` of a ``supported``
    dtype, both alike, holding ``quant``'s codes (with its per-row scales) or float values."""
    if key_cache.dim() != 4 or key_cache.shape[1:] != (block_size, num_kv_heads, head_dim):
        raise ValueError(
            f"key_cache must be [num_blocks, block_size={block_size}, "
            f"num_kv_heads={num_kv_heads}, head_dim={head_dim}], "
            f"got {list(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            "value_cache must have key_cache's shape and dtype, got "
            f"{list(value_cache.shape)} {value_cache.dtype} vs {key_cache.dtype}"
        )
    if key_cache.dtype not in supported:
        raise ValueError(f"cache dtype must be one of {supported}, got {key_cache.dtype}")
    codes = {None: None, "fp8": torch.float8_e4m3fn, "int8": torch.int8}[
        None if quant is None else quant.dtype
    ]
    if (codes is None) != (key_cache.dtype not in (torch.float8_e4m3fn, torch.int8)) or (
        codes is not None and key_cache.dtype != codes
    ):
        raise ValueError(
            f"a {key_cache.dtype} cache cannot be read with kv quantization {quant and quant.dtype}"
        )
    if quant is not None and (quant.dtype == "int8" or quant.key_scales is not None):
        for scales in (quant.key_scales, quant.value_scales):
            if scales is None or scales.shape != key_cache.shape[:-1] or scales.dtype != torch.float32:
                raise ValueError(f"per-row KV scales must be float32 {list(key_cache.shape[:-1])}")
    if value_cache.device != key_cache.device:
        raise ValueError(f"key_cache is on {key_cache.device} but value_cache on {value_cache.device}")


def check_metadata(meta: AttentionMetadata) -> None:
    """Host-side checks of the step layout (no device sync): what the kernels rely on."""
    if meta.block_size < 1:
        raise ValueError(f"block_size must be positive, got {meta.block_size}")
    if len(meta.query_lens_host) != meta.num_seqs:
        raise ValueError(f"{len(meta.query_lens_host)} query lengths for {meta.num_seqs} sequences")
    if not 0 <= meta.num_decodes <= meta.num_seqs:
        raise ValueError(f"num_decodes={meta.num_decodes} outside 0..{meta.num_seqs}")
    if any(q != 1 for q in meta.query_lens_host[: meta.num_decodes]):
        raise ValueError("the leading num_decodes sequences must have exactly one new token each")
    if any(q < 1 or q > s for q, s in zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
        raise ValueError("every sequence needs 1 <= query length <= seq_len")
    if sum(meta.query_lens_host) != meta.num_tokens:
        raise ValueError(
            f"query lengths sum to {sum(meta.query_lens_host)}, but there are "
            f"{meta.num_tokens} slots in slot_mapping"
        )
    for label, tensor, dtype in (
        ("query_start_loc", meta.query_start_loc, torch.int32),
        ("seq_lens", meta.seq_lens, torch.int32),
        ("block_tables", meta.block_tables, torch.int32),
        ("slot_mapping", meta.slot_mapping, torch.int64),
    ):
        if tensor.dtype != dtype:
            raise ValueError(f"{label} must be {dtype}, got {tensor.dtype}")
        # the kernels step through these with unit stride
        if tensor.dim() and tensor.stride(-1) != 1:
            raise ValueError(f"{label} must be contiguous in its last dimension")
    if meta.block_tables.dim() != 2 or meta.block_tables.shape[0] < meta.num_seqs:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks], got {list(meta.block_tables.shape)}")
    if meta.block_tables.shape[1] * meta.block_size < meta.max_seq_len:
        raise ValueError(
            f"block_tables hold {meta.block_tables.shape[1]} blocks of {meta.block_size}, "
            f"fewer than the longest sequence ({meta.max_seq_len} tokens)"
        )
