"""Physical KV blocks: reference counts, an LRU free queue, and the hash → block map of cached blocks.

A block is *in use* (ref_cnt > 0), *cached-free* (ref_cnt 0, still holding a cached prefix, evictable),
or *free* (ref_cnt 0, no hash). Free and cached-free blocks share one queue in LRU order: allocation takes
from the front, evicting a cached block's hash only when its block is reused, so only unreferenced cached
blocks are ever evicted. Block 0 is reserved (it pads block tables) and is never handed out.
"""

from __future__ import annotations

from collections import OrderedDict

from kvpilot.engine.kv.events import KVEventLog


class OutOfBlocks(RuntimeError):
    """More blocks were requested than are free; callers check ``num_free`` first."""


class BlockPool:
    def __init__(
        self, num_blocks: int, enable_caching: bool = True, events: KVEventLog | None = None
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.events = events or KVEventLog()
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self._cached: dict[bytes, int] = {}

    # ---- queries -------------------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks allocation can hand out now (free + cached-free)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_cached_free(self) -> int:
        return sum(1 for b in self._free if self.block_hash[b] is not None)

    @property
    def num_in_use(self) -> int:
        return self.num_usable - len(self._free)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def cached_hashes(self) -> list[bytes]:
        return list(self._cached)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    # ---- mutations -----------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with ref_cnt 1, least recently freed first (evicting their cached hashes)."""
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self._free)} free")
        out, evicted = [], []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                evicted.append(h)
                del self._cached[h]
                self.block_hash[b] = None
            self.ref_cnt[b] = 1
            out.append(b)
        self.events.removed(evicted)
        return out

    def touch(self, blocks: list[int]) -> None:
        """Take another reference to each block (a prefix hit or a fork); revives cached-free blocks."""
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self._free[b]
            self.ref_cnt[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 join the back of the LRU queue in the order
        given (callers pass a sequence's blocks tail-first so its tail is evicted before its shared head)."""
        for b in blocks:
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free[b] = None

    def cache(self, block_id: int, block_hash: bytes) -> bool:
        """Register a full, computed block under its hash. False (and nothing changes) when the hash is
        already cached in another block — the duplicate simply stays private to its sequence."""
        if not self.enable_caching or self.block_hash[block_id] is not None:
            return False
        if block_hash in self._cached:
            return False
        self._cached[block_hash] = block_id
        self.block_hash[block_id] = block_hash
        self.events.stored([block_hash])
        return True

    def reset_cache(self) -> int:
        """Forget every cached hash (blocks in use keep their data); returns how many were dropped."""
        n = len(self._cached)
        for b in self._cached.values():
            self.block_hash[b] = None
        self._cached.clear()
        self.events.cleared()
        return n

    # ---- invariants ----------------------------------------------------------------------------------
    def check(self) -> None:
        assert self.ref_cnt[0] == 0 and 0 not in self._free, "block 0 must stay reserved"
        free_uncached = sum(1 for b in self._free if self.block_hash[b] is None)
        in_use = sum(1 for b in range(1, self.num_blocks) if self.ref_cnt[b] > 0)
        assert free_uncached + self.num_cached_free + in_use == self.num_usable, "block accounting broken"
        for b in range(1, self.num_blocks):
            assert (self.ref_cnt[b] == 0) == (b in self._free), f"block {b}: ref_cnt/free-queue disagree"
        for h, b in self._cached.items():
            assert self.block_hash[b] == h, f"hash map and block {b} disagree"
