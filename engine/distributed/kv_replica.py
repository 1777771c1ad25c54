"""Every rank's paged KV cache under rank 0's block tables (docs/architecture.md#tensor-parallelism).

Each rank holds the K/V of its own heads in a cache of the same number of blocks, and block ``b`` means
the same tokens on every rank: only rank 0's KV manager chooses blocks. What it does to block contents
outside a forward — a copy-on-write copy, a swap-out to host blocks, a swap-in — rank 0's cache and swap
space record as ``KVOp``s; the next step's message carries them, and each worker replays them, in order,
before its forward, with rank 0's choice of host blocks.
"""

from __future__ import annotations

from typing import Any

from kvpilot.engine.distributed.step_message import COPY, SWAP_IN, SWAP_OUT, KVOp
from kvpilot.engine.kv.kv_cache import HostSwapSpace, KVCache


class RecordingKVCache(KVCache):
    """Rank 0's cache: copies blocks and records the copy for the workers."""

    def __init__(self, *args: Any, ops: list[KVOp], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ops = ops

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        super().copy_blocks(src, dst)
        self.ops.append(KVOp(COPY, list(src), list(dst)))


class RecordingSwapSpace(HostSwapSpace):
    """Rank 0's swap space: moves blocks and records the move (with the host blocks it chose)."""

    def __init__(self, cache: KVCache, num_blocks: int, ops: list[KVOp]) -> None:
        super().__init__(cache, num_blocks)
        self.ops = ops

    def copy_out(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        super().copy_out(device_blocks, host_blocks)
        self.ops.append(KVOp(SWAP_OUT, list(device_blocks), list(host_blocks)))

    def copy_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        super().copy_in(host_blocks, device_blocks)
        self.ops.append(KVOp(SWAP_IN, list(host_blocks), list(device_blocks)))


def replay(ops: list[KVOp], cache: KVCache, swap: HostSwapSpace | None) -> None:
    """A worker's cache (and swap space) after rank 0's ``ops``, in their order."""
    for op in ops:
        if op.kind == COPY:
            cache.copy_blocks(op.src, op.dst)
            continue
        if swap is None:
            raise RuntimeError("rank 0 swapped KV blocks but this rank has no swap space")
        if op.kind == SWAP_OUT:
            swap.copy_out(op.src, op.dst)
        elif op.kind == SWAP_IN:
            swap.copy_in(op.src, op.dst)
        else:
            raise RuntimeError(f"unknown KV operation kind {op.kind}")
