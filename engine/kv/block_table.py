"""The block tables of the sequences that hold device blocks, as one persistent tensor
(docs/architecture.md#persistent-batch).

``KVCacheManager``'s per-sequence lists stay the source of truth; every change to them is mirrored here as
it happens, into a preallocated int32 ``[capacity, max_blocks_per_seq]`` table, so a step reads its block
tables by row instead of rebuilding them from lists: a new block writes one element, a copy-on-write
replaces one, a fork or a swap-in writes its row once, and a dropped table zeroes its row (entries past a
table's length are always 0: block 0 pads).

Rows are slots. A sequence takes the lowest free slot when its table is created and gives it back when the
table is dropped: a free list with an index map (SGLang's ``ReqToTokenPool`` keeps its request rows so)
rather than vLLM's compaction of the batch on every departure, because a step's batch is a gather of rows
by slot either way — it schedules a subset of the running sequences, in its own order. The capacity starts
at ``max_num_seqs`` and doubles if it is ever exceeded; the width grows the same way.

Writes go to a numpy view of the host table (an element write costs no tensor dispatch). On a device other
than the CPU the table also has a device copy: the writes are queued as (flat index, value) pairs and
``commit`` applies them there in one scatter per step, uploaded through the pinned staging buffer.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from kvpilot.engine.staging import Staging


class BlockTableTensor:
    def __init__(self, capacity: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.device = device
        self.host = torch.zeros(max(1, capacity), max(1, max_blocks_per_seq), dtype=torch.int32)
        self._np = self.host.numpy()
        #: blocks in each slot's table (its row's valid prefix)
        self.num_blocks: list[int] = [0] * self.capacity
        #: sequence id → slot
        self.slot_of: dict[str, int] = {}
        self._free = list(range(self.capacity))  # a heap: the lowest free slot first
        self._mirrored = device.type != "cpu"
        self.device_table = self.host.to(device) if self._mirrored else self.host
        self._pending_index: list[int] = []
        self._pending_value: list[int] = []
        self._staging = Staging(device, torch.int64) if self._mirrored else None

    @property
    def capacity(self) -> int:
        return int(self.host.shape[0])

    @property
    def width(self) -> int:
        return int(self.host.shape[1])

    # ---- changes (called by KVCacheManager) ----------------------------------------------------------
    def assign(self, seq_id: str, blocks: Sequence[int]) -> int:
        """A new table for ``seq_id``: take a slot and write its row."""
        if not self._free:
            self._resize(2 * self.capacity, self.width)
        slot = heapq.heappop(self._free)
        self.slot_of[seq_id] = slot
        self._write(slot, 0, blocks)
        self.num_blocks[slot] = len(blocks)
        return slot

    def append(self, seq_id: str, blocks: Sequence[int]) -> None:
        slot = self.slot_of[seq_id]
        self._write(slot, self.num_blocks[slot], blocks)
        self.num_blocks[slot] += len(blocks)

    def replace(self, seq_id: str, index: int, block: int) -> None:
        """Entry ``index`` of the table now holds ``block`` (copy-on-write of a shared block)."""
        self._write(self.slot_of[seq_id], index, [block])

    def truncate(self, seq_id: str, num_blocks: int) -> None:
        """The table keeps its first ``num_blocks`` entries (rejected draft tokens' blocks are released)."""
        slot = self.slot_of[seq_id]
        extra = self.num_blocks[slot] - num_blocks
        if extra > 0:
            self._write(slot, num_blocks, [0] * extra)
            self.num_blocks[slot] = num_blocks

    def drop(self, seq_id: str) -> None:
        """The table is gone: zero its row and free the slot."""
        slot = self.slot_of.pop(seq_id, None)
        if slot is None:
            return
        self._write(slot, 0, [0] * self.num_blocks[slot])
        self.num_blocks[slot] = 0
        heapq.heappush(self._free, slot)

    def _write(self, slot: int, start: int, blocks: Sequence[int]) -> None:
        end = start + len(blocks)
        if not blocks:
            return
        if end > self.width:
            self._resize(self.capacity, max(end, 2 * self.width))
        self._np[slot, start:end] = blocks
        if self._mirrored:
            base = slot * self.width + start
            self._pending_index.extend(range(base, base + len(blocks)))
            self._pending_value.extend(blocks)

    def _resize(self, capacity: int, width: int) -> None:
        old = self.host
        self.host = torch.zeros(capacity, width, dtype=torch.int32)
        self.host[: old.shape[0], : old.shape[1]] = old
        self._np = self.host.numpy()
        self._free.extend(range(len(self.num_blocks), capacity))
        heapq.heapify(self._free)
        self.num_blocks.extend([0] * (capacity - len(self.num_blocks)))
        if self._mirrored:  # flat indices change with the width: start the device copy afresh
            self.device_table = self.host.to(self.device)
            self._pending_index, self._pending_value = [], []
        else:
            self.device_table = self.host

    # ---- reading -------------------------------------------------------------------------------------
    def commit(self) -> None:
        """Apply the queued writes to the device copy (nothing to do on the CPU)."""
        if not self._pending_index:
            return
        assert self._staging is not None
        index, value = self._staging.upload(
            np.asarray(self._pending_index, dtype=np.int64), np.asarray(self._pending_value, dtype=np.int64)
        )
        self.device_table.view(-1).index_put_((index,), value.to(torch.int32))
        self._pending_index, self._pending_value = [], []

    def row(self, seq_id: str) -> list[int]:
        """The mirrored table of ``seq_id`` (tests and invariant checks)."""
        slot = self.slot_of[seq_id]
        return self._np[slot, : self.num_blocks[slot]].tolist()

    def check(self, tables: Mapping[str, list[int]]) -> None:
        """The mirror equals ``tables`` exactly: same sequences, same rows, zeros past each table, every
        other slot free and zero (``KVCacheManager.check_invariants``)."""
        assert set(self.slot_of) == set(tables), "block-table slots != sequences with tables"
        expected = np.zeros_like(self._np)
        for seq_id, table in tables.items():
            slot = self.slot_of[seq_id]
            assert self.num_blocks[slot] == len(table), f"{seq_id}: {self.num_blocks[slot]} != {len(table)}"
            expected[slot, : len(table)] = table
        assert np.array_equal(self._np, expected), "the block-table tensor differs from the block tables"
        used = set(self.slot_of.values())
        assert len(used) == len(self.slot_of) and used.isdisjoint(self._free), "a slot is used twice"
        assert len(used) + len(self._free) == self.capacity, "a slot is lost"
        if self._mirrored:
            self.commit()
            assert torch.equal(self.device_table.cpu(), self.host), "the device copy differs from the host"
