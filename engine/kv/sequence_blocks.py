"""``SequenceBlocks``, everything ``KVCacheManager`` holds for one sequence, and the checks of all records
against the pool and the swap space (docs/architecture.md#kv-lifecycle). One record per sequence, so adding,
forking, swapping, preempting and releasing a sequence change one entry, and ``forget`` drops it whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpilot.engine.kv.block_pool import BlockPool

if TYPE_CHECKING:
    from kvpilot.engine.kv.kv_cache import HostSwapSpace


@dataclass(slots=True)
class SequenceBlocks:
    """The KV manager's state for one sequence, from its first lookup, reservation or allocation until
    ``forget``."""

    #: physical blocks in position order; None while it holds no device blocks (queued, preempted, swapped
    #: out), which differs from an empty table: only a table has a ``BlockTableTensor`` row
    table: list[int] | None = None
    #: leading blocks of ``table`` already registered in the prefix cache
    num_committed: int = 0
    #: host swap blocks holding its K/V while it is swapped out
    swapped: list[int] | None = None
    #: blocks promised to it while it is queued (accounting only: docs/architecture.md#admission)
    reservation: int = 0
    #: its cache salt and adapter id encoded for its block hashes, computed on its first hash
    extra_keys: bytes | None = None


def check_sequence_blocks(
    records: Mapping[str, SequenceBlocks], pool: BlockPool, swap: HostSwapSpace | None, num_reserved: int
) -> None:
    """The pool's own accounting (free + cached-free + in-use == total); each block's ref_cnt == its
    block-table references; each record's committed blocks within its table, and device or host blocks,
    not both; host blocks and reservations adding up to the swap space's use and ``num_reserved``."""
    pool.check()
    refs = [0] * pool.num_blocks
    num_host, reserved = 0, 0
    for seq_id, rec in records.items():
        table = rec.table or []
        for b in table:
            refs[b] += 1
        assert rec.num_committed <= len(table), f"{seq_id}: {rec.num_committed} committed > {len(table)}"
        assert rec.table is None or rec.swapped is None, f"{seq_id} holds both device and host blocks"
        num_host += len(rec.swapped or ())
        reserved += rec.reservation
    for b in range(1, pool.num_blocks):
        assert refs[b] == pool.ref_cnt[b], (
            f"block {b}: ref_cnt {pool.ref_cnt[b]} != {refs[b]} block-table references"
        )
    assert reserved == num_reserved, f"reservations add up to {reserved}, the manager counts {num_reserved}"
    if swap is not None:
        assert num_host == swap.num_blocks - swap.num_free, "host swap blocks lost or held twice"
