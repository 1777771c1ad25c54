"""Block pool: reference counts, LRU free queue, hash map, events, invariants."""

import pytest

from kvpilot.engine.kv.block_hash import block_hashes, encode_extra_keys, hash_block, root_hash
from kvpilot.engine.kv.block_pool import BlockPool, OutOfBlocks
from kvpilot.engine.kv.events import KVEventLog


def test_block_zero_is_reserved_and_allocation_is_lru_order():
    pool = BlockPool(5)
    assert pool.num_usable == 4 and pool.num_free == 4
    assert pool.allocate(2) == [1, 2]
    assert pool.allocate(1) == [3]
    pool.free([2])
    pool.free([1])
    # 4 was never used, then 2 and 1 were freed in that order
    assert pool.allocate(3) == [4, 2, 1]
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)
    pool.check()


def test_cached_blocks_are_evicted_only_when_unreferenced_and_reused():
    events = KVEventLog()
    pool = BlockPool(4, events=events)
    a, b = pool.allocate(2)
    assert pool.cache(a, b"h-a") and pool.cache(b, b"h-b")
    assert not pool.cache(b, b"h-other")  # a block holds one hash
    pool.free([b, a])
    assert pool.num_cached_free == 2 and pool.num_free == 3
    # a prefix hit revives a cached-free block without evicting it
    assert pool.lookup(b"h-a") == a
    pool.touch([a])
    assert pool.ref_cnt[a] == 1 and pool.num_cached == 2
    # allocation takes the never-used block 3 first, then evicts b (freed before a was revived)
    assert pool.allocate(1) == [3]
    assert pool.allocate(1) == [b]
    assert pool.lookup(b"h-b") is None and pool.lookup(b"h-a") == a
    batch = events.since(0)
    assert [(e.kind, e.hashes) for e in batch.events] == [
        ("stored", (b"h-a".hex(),)),
        ("stored", (b"h-b".hex(),)),
        ("removed", (b"h-b".hex(),)),
    ]
    pool.check()


def test_double_free_raises():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a])


def test_duplicate_hash_stays_private():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache(a, b"same")
    assert not pool.cache(b, b"same")
    assert pool.lookup(b"same") == a and pool.block_hash[b] is None


def test_hash_chain_is_stable_and_salted():
    root = root_hash("model-x")
    assert root == root_hash("model-x") and root != root_hash("model-y")
    toks = list(range(10))
    hs = block_hashes(toks, 4, root)
    assert len(hs) == 2  # only full blocks
    assert hs[0] == hash_block(root, toks[:4]) and hs[1] == hash_block(hs[0], toks[4:8])
    # resuming the chain from block 1 gives the same hash
    assert block_hashes(toks, 4, root, start=1, parent=hs[0]) == hs[1:]
    salted = block_hashes(toks, 4, root, encode_extra_keys(cache_salt="tenant-a"))
    assert salted[0] != hs[0]
    assert salted != block_hashes(toks, 4, root, encode_extra_keys(cache_salt="tenant-b"))
    assert encode_extra_keys(cache_salt="") != encode_extra_keys()  # empty salt is still a salt
    assert hs[0].hex() == hash_block(root_hash("model-x"), [0, 1, 2, 3]).hex()


def test_event_log_gap_and_epoch():
    log = KVEventLog(capacity=3)
    for i in range(5):
        log.stored([bytes([i])])
    assert log.seq == 5
    batch = log.since(3)
    assert not batch.gap and [e.seq for e in batch.events] == [4, 5]
    assert log.since(1).gap  # events 2.. were dropped (only 3,4,5 kept)
    assert not log.since(2).gap
    assert log.since(9).gap  # a reader ahead of the log saw another epoch
    assert log.since(5).events == [] and not log.since(5).gap
    assert KVEventLog().epoch != log.epoch
