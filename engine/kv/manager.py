"""Per-request block tables on top of the block pool: prefix lookup, slot allocation, caching of computed
blocks, admission reservations, swap, and the invariant check. All it holds for a sequence is one
``SequenceBlocks`` record, which ``forget`` drops whole (docs/architecture.md#kv-lifecycle). With a
``BlockTableTensor`` every table change is also written there as it happens
(docs/architecture.md#persistent-batch).

Prefix hits are capped at ``num_tokens - 1`` so the last prompt token is always computed: the first output
token needs its logits, and the cache holds only K/V (docs/architecture.md#prefix-cache).
"""

from __future__ import annotations

from collections import abc
from collections.abc import Iterable, KeysView, Mapping

from kvpilot.engine.kv.block_hash import block_hashes, encode_extra_keys
from kvpilot.engine.kv.block_pool import BlockPool
from kvpilot.engine.kv.block_table import BlockTableTensor
from kvpilot.engine.kv.capacity import SlotUsage, blocks_for_tokens, slot_usage
from kvpilot.engine.kv.kv_cache import HostSwapSpace, KVCache
from kvpilot.engine.kv.sequence_blocks import SequenceBlocks, check_sequence_blocks
from kvpilot.engine.sequence import Sequence


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        root_hash: bytes,
        cache: KVCache | None = None,
        swap: HostSwapSpace | None = None,
        block_tensor: BlockTableTensor | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.root_hash = root_hash
        self.cache = cache
        self.swap = swap
        #: the tables as one persistent tensor, kept equal to ``tables`` (None: lists only)
        self.block_tensor = block_tensor
        #: request id → its record
        self._seqs: dict[str, SequenceBlocks] = {}
        #: the records' reservations summed, kept as they change (admission reads it per request)
        self._num_reserved = 0

    @property
    def caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def tables(self) -> Mapping[str, list[int]]:
        """Sequence id → block table of each sequence that has one (built per call: checks and tests)."""
        return {seq_id: rec.table for seq_id, rec in self._seqs.items() if rec.table is not None}

    @property
    def sequence_ids(self) -> KeysView[str]:
        """The requests the manager holds anything for (a live view)."""
        return self._seqs.keys()

    def _record(self, req: Sequence) -> SequenceBlocks:
        rec = self._seqs.get(req.seq_id)
        if rec is None:
            rec = self._seqs[req.seq_id] = SequenceBlocks()
        return rec

    def _table(self, req: Sequence) -> list[int] | None:
        rec = self._seqs.get(req.seq_id)
        return None if rec is None else rec.table

    # ---- hashing and lookup --------------------------------------------------------------------------
    def update_block_hashes(self, req: Sequence) -> None:
        """Extend ``req.block_hashes`` to cover every full block of its tokens."""
        have = len(req.block_hashes)
        if req.num_tokens // self.block_size > have:
            rec = self._record(req)
            if rec.extra_keys is None:
                rec.extra_keys = encode_extra_keys(req.cache_salt, req.adapter_id)
            parent = req.block_hashes[-1] if have else None
            req.block_hashes.extend(
                block_hashes(
                    req.all_token_ids,
                    self.block_size,
                    self.root_hash,
                    rec.extra_keys,
                    start=have,
                    parent=parent,
                )
            )

    def lookup_prefix(self, req: Sequence) -> list[int]:
        """Cached blocks that match ``req``'s leading full blocks (no references taken)."""
        if not self.caching:
            return []
        self.update_block_hashes(req)
        limit = (req.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in req.block_hashes[:limit]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def count_prefix_hit_tokens(self, req: Sequence) -> int:
        return len(self.lookup_prefix(req)) * self.block_size

    # ---- allocation ----------------------------------------------------------------------------------
    def _needs_copy_on_write(self, req: Sequence, table: list[int]) -> bool:
        """The next token goes into a partially filled last block that another sequence also references."""
        return (
            bool(table)
            and req.num_computed_tokens % self.block_size != 0
            and req.num_computed_tokens // self.block_size == len(table) - 1
            and self.pool.ref_cnt[table[-1]] > 1
        )

    def blocks_to_allocate(self, req: Sequence, num_new_tokens: int, hits: abc.Sequence[int] = ()) -> int:
        """Free blocks that scheduling ``num_new_tokens`` more tokens would consume (hits that are now
        cached-free count too: reviving them takes them out of the free queue; a shared partial last
        block that must be copied before it is written counts one)."""
        table = self.block_table(req)
        total = req.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        new = max(0, blocks_for_tokens(total, self.block_size) - len(table) - len(hits))
        return new + sum(1 for b in hits if self.pool.ref_cnt[b] == 0) + self._needs_copy_on_write(req, table)

    def allocate(self, req: Sequence, num_new_tokens: int, hits: abc.Sequence[int] = ()) -> bool:
        """Make ``req``'s block table cover its computed tokens, ``hits`` and ``num_new_tokens`` more.
        Returns False (changing nothing) when the pool cannot supply the blocks."""
        rec = self._seqs.get(req.seq_id)
        table = None if rec is None else rec.table
        if (  # most decode steps: the last block has room and is this sequence's own
            not hits
            and table is not None
            and req.num_computed_tokens + num_new_tokens <= len(table) * self.block_size
            and not self._needs_copy_on_write(req, table)
        ):
            return True
        if self.blocks_to_allocate(req, num_new_tokens, hits) > self.pool.num_free:
            return False
        if rec is None:
            rec = self._record(req)
        if table is None:
            table = self._new_table(req.seq_id, rec, [])
        if self._needs_copy_on_write(req, table):
            self._copy_on_write(req.seq_id, table)
        if hits:
            self.pool.touch(list(hits))
            self._extend(req.seq_id, table, hits)
            rec.num_committed = len(table)
        total = req.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        need = blocks_for_tokens(total, self.block_size) - len(table)
        if need > 0:
            self._extend(req.seq_id, table, self.pool.allocate(need))
        return True

    def _new_table(self, seq_id: str, rec: SequenceBlocks, blocks: list[int]) -> list[int]:
        rec.table = blocks
        if self.block_tensor is not None:
            self.block_tensor.assign(seq_id, blocks)
        return blocks

    def _extend(self, seq_id: str, table: list[int], blocks: abc.Sequence[int]) -> None:
        table.extend(blocks)
        if self.block_tensor is not None:
            self.block_tensor.append(seq_id, blocks)

    def _copy_on_write(self, seq_id: str, table: list[int]) -> None:
        """Give the table a private copy of its shared last block (never write a shared block:
        docs/architecture.md#kv-lifecycle)."""
        if self.cache is None:
            raise RuntimeError("copy-on-write needs the KV cache tensors")
        (private,) = self.pool.allocate(1)
        self.cache.copy_blocks([table[-1]], [private])
        self.pool.free([table[-1]])
        table[-1] = private
        if self.block_tensor is not None:
            self.block_tensor.replace(seq_id, len(table) - 1, private)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` (reference counts, no copies); the shared partial last
        block is copied on the first write of either sequence."""
        source = self._seqs.get(parent.seq_id)
        table = list(source.table) if source is not None and source.table is not None else []
        self.pool.touch(table)
        rec = self._record(child)
        self._new_table(child.seq_id, rec, table)
        rec.num_committed = 0 if source is None else source.num_committed
        child.block_hashes = list(parent.block_hashes[: child.num_tokens // self.block_size])

    def commit_computed(self, req: Sequence, num_computed_tokens: int) -> None:
        """Register the blocks that ``num_computed_tokens`` fill completely in the prefix cache."""
        if not self.caching:
            return
        rec = self._seqs.get(req.seq_id)
        if rec is None or rec.table is None:
            return
        table = rec.table
        full = min(num_computed_tokens // self.block_size, len(table))
        done = rec.num_committed
        if full <= done:
            return
        self.update_block_hashes(req)
        for i in range(done, full):
            self.pool.cache(table[i], req.block_hashes[i])
        rec.num_committed = full

    def truncate(self, req: Sequence, num_tokens: int) -> None:
        """Release the blocks of ``req``'s table past those ``num_tokens`` tokens need (the slots of rejected
        draft tokens, docs/architecture.md#speculative-decoding), tail first."""
        table = self._table(req)
        keep = blocks_for_tokens(num_tokens, self.block_size)
        if table is None or len(table) <= keep:
            return
        surplus = table[keep:]
        del table[keep:]
        if self.block_tensor is not None:
            self.block_tensor.truncate(req.seq_id, keep)
        self.pool.free(list(reversed(surplus)))

    def free(self, req: Sequence) -> None:
        """Drop the request's references, tail first so its private tail is evicted before shared heads."""
        rec = self._seqs.get(req.seq_id)
        if rec is None or rec.table is None:
            return
        table, rec.table, rec.num_committed = rec.table, None, 0
        if self.block_tensor is not None:
            self.block_tensor.drop(req.seq_id)
        if table:
            self.pool.free(list(reversed(table)))

    def forget(self, req: Sequence) -> None:
        """Drop every trace of a finished request (blocks, swap, reservation): its record goes."""
        self.free(req)
        rec = self._seqs.pop(req.seq_id, None)
        if rec is None:
            return
        self._num_reserved -= rec.reservation
        if rec.swapped is not None and self.swap is not None:
            self.swap.release(rec.swapped)

    def block_table(self, req: Sequence) -> list[int]:
        table = self._table(req)
        return [] if table is None else table

    # ---- admission reservations (accounting only: docs/architecture.md#admission) --------------------
    def reserve(self, req: Sequence, num_blocks: int) -> None:
        rec = self._record(req)
        self._num_reserved += num_blocks - rec.reservation
        rec.reservation = num_blocks

    def release_reservation(self, req: Sequence) -> int:
        rec = self._seqs.get(req.seq_id)
        if rec is None:
            return 0
        released, rec.reservation = rec.reservation, 0
        self._num_reserved -= released
        return released

    @property
    def num_reserved_blocks(self) -> int:
        return self._num_reserved

    def admission_headroom(self) -> int:
        """Blocks not yet promised: free blocks minus outstanding reservations of queued requests."""
        return self.pool.num_free - self.num_reserved_blocks

    # ---- swap ----------------------------------------------------------------------------------------
    def can_swap_out(self, req: Sequence) -> bool:
        return self.swap is not None and self.swap.num_free >= len(self.block_table(req))

    def swap_out(self, req: Sequence) -> None:
        assert self.swap is not None
        host = self.swap.swap_out(self.block_table(req))
        self._record(req).swapped = host
        self.free(req)

    def swap_in(self, req: Sequence, num_new_tokens: int) -> bool:
        """Copy a swapped request back into fresh device blocks, with room for ``num_new_tokens`` more."""
        assert self.swap is not None
        rec = self._seqs[req.seq_id]
        host = rec.swapped
        assert host is not None, f"{req.seq_id} is not swapped out"
        total = blocks_for_tokens(req.num_computed_tokens + num_new_tokens, self.block_size)
        if max(total, len(host)) > self.pool.num_free:
            return False
        device = self.pool.allocate(len(host))
        self.swap.swap_in(host, device)
        rec.swapped = None
        self._new_table(req.seq_id, rec, device)
        rec.num_committed = 0
        return self.allocate(req, num_new_tokens)

    # ---- accounting and invariants -------------------------------------------------------------------
    def slot_usage(self, reqs: Iterable[Sequence]) -> SlotUsage:
        """Logical vs allocated slots over the given requests' block tables."""
        held = [(r, t) for r in reqs if (t := self._table(r)) is not None]
        usage = slot_usage([r.num_computed_tokens for r, _ in held], self.block_size)
        allocated = sum(len(t) for _, t in held) * self.block_size
        return type(usage)(usage.logical_slots, allocated)

    def check_invariants(self) -> None:
        """free + cached-free + in-use == total, each block's ref_cnt == its block-table references, each
        record consistent with the pool, the swap space, the reserved total and the block-table tensor."""
        check_sequence_blocks(self._seqs, self.pool, self.swap, self._num_reserved)
        if self.block_tensor is not None:
            self.block_tensor.check(self.tables)
