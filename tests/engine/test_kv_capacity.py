"""KV arithmetic from the engine's own code (docs/architecture.md#kv-cache-sizing): bytes per token,
internal fragmentation of last blocks, blocks per budget, KV heads per tensor-parallel shard, and
prefix sharing of full blocks (docs/architecture.md#prefix-cache)."""

import pytest

from kvpilot.engine.kv.block_pool import BlockPool
from kvpilot.engine.kv.capacity import (
    kv_bytes_per_token,
    kv_heads_per_shard,
    num_blocks_for_memory,
    slot_usage,
)
from kvpilot.engine.kv.manager import KVCacheManager
from kvpilot.engine.sampling.params import SamplingParams
from kvpilot.engine.sequence import Sequence


def test_bytes_per_token_is_2_layers_heads_dim_bytes():
    assert kv_bytes_per_token(n_layer=2, n_kv_head=2, d_head=4, bytes_per_elem=2) == 64
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, fp32
    assert kv_bytes_per_token(30, 3, 64, 4) == 46080


def test_internal_fragmentation_lengths_1_and_5_block_4():
    usage = slot_usage([1, 5], block_size=4)
    assert (usage.logical_slots, usage.allocated_slots) == (6, 12)
    assert usage.logical_slots * 64 == 384 and usage.allocated_slots * 64 == 768
    assert usage.fragmentation == pytest.approx(0.5)


def test_capacity_from_memory_budget():
    assert num_blocks_for_memory(64 * 4 * 10, bytes_per_token=64, block_size=4) == 10
    assert num_blocks_for_memory(64 * 4 * 10 - 1, bytes_per_token=64, block_size=4) == 9


def test_kv_heads_not_divisible_by_tp_degree_is_refused():
    assert kv_heads_per_shard(8, 4) == 2
    assert kv_heads_per_shard(2, 4) == 1  # replicated heads
    with pytest.raises(ValueError, match="cannot be sharded"):
        kv_heads_per_shard(3, 2)


def _req(rid, tokens):
    return Sequence(rid, tokens, SamplingParams(max_tokens=1))


def test_prefix_sharing_lengths_6_and_7_share_one_full_block():
    """Without sharing, lengths [6, 7] take 2 + 2 = 4 blocks of 4; sharing the full first block → 3."""
    pool = BlockPool(16)
    kv = KVCacheManager(pool, block_size=4, root_hash=b"r" * 16)
    a = _req("a", [1, 2, 3, 4, 5, 6])
    b = _req("b", [1, 2, 3, 4, 9, 9, 9])
    assert kv.allocate(a, 6)
    a.num_computed_tokens = 6
    kv.commit_computed(a, 6)
    hits = kv.lookup_prefix(b)
    assert hits == kv.block_table(a)[:1]
    assert kv.allocate(b, 7 - 4, hits)
    assert pool.num_in_use == 3
    assert kv.block_table(a)[0] == kv.block_table(b)[0]
    assert pool.ref_cnt[kv.block_table(a)[0]] == 2
    kv.check_invariants()
    # a sub-block overlap shares nothing
    c = _req("c", [1, 2, 3, 7, 7, 7])
    assert kv.lookup_prefix(c) == []


def test_logical_vs_allocated_slots_reported_by_manager():
    pool = BlockPool(16)
    kv = KVCacheManager(pool, block_size=4, root_hash=b"r" * 16)
    a, b = _req("a", [1]), _req("b", [1, 2, 3, 4, 5])
    for r in (a, b):
        assert kv.allocate(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens
    usage = kv.slot_usage([a, b])
    assert (usage.logical_slots, usage.allocated_slots) == (6, 12)
