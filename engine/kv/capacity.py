"""KV capacity arithmetic (docs/architecture.md#kv-cache-sizing): bytes per token, blocks per budget, and
internal fragmentation.

``m_token = 2 · n_layer · n_kv_head · (d_head · bytes_per_elem + scale_bytes)`` is the ideal payload (K and
V; ``scale_bytes`` is what a quantized cache keeps per (token, KV head) beside its codes: int8's float32
scale, docs/architecture.md#kv-cache-dtype); block allocation rounds every sequence up to whole blocks, so
allocated slots exceed logical ones.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


def kv_bytes_per_token(
    n_layer: int, n_kv_head: int, d_head: int, bytes_per_elem: int, scale_bytes: int = 0
) -> int:
    for name, v in (
        ("n_layer", n_layer),
        ("n_kv_head", n_kv_head),
        ("d_head", d_head),
        ("bytes_per_elem", bytes_per_elem),
    ):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    if scale_bytes < 0:
        raise ValueError(f"scale_bytes must be >= 0, got {scale_bytes}")
    return 2 * n_layer * n_kv_head * (d_head * bytes_per_elem + scale_bytes)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def num_blocks_for_memory(memory_bytes: int, bytes_per_token: int, block_size: int) -> int:
    """Whole blocks that fit in ``memory_bytes`` (block 0, the reserved null block, included)."""
    return memory_bytes // (bytes_per_token * block_size)


@dataclass(frozen=True)
class SlotUsage:
    logical_slots: int
    allocated_slots: int

    @property
    def fragmentation(self) -> float:
        """Fraction of allocated slots that hold no token (internal fragmentation of last blocks)."""
        return 0.0 if not self.allocated_slots else 1 - self.logical_slots / self.allocated_slots


def slot_usage(lengths: Iterable[int], block_size: int) -> SlotUsage:
    lengths = list(lengths)
    return SlotUsage(sum(lengths), sum(blocks_for_tokens(n, block_size) for n in lengths) * block_size)


def kv_heads_per_shard(n_kv_head: int, tp_degree: int) -> int:
    """KV heads each tensor-parallel rank holds; heads that do not divide evenly cannot simply be split."""
    if tp_degree <= 0:
        raise ValueError(f"tp_degree must be positive, got {tp_degree}")
    if n_kv_head % tp_degree and tp_degree % n_kv_head:
        raise ValueError(
            f"{n_kv_head} KV heads cannot be sharded over TP degree {tp_degree}: neither divides the other"
        )
    return max(1, n_kv_head // tp_degree)
