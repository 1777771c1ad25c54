"""Scoring: exact choices for the cases the cost model exists for, and invariants over random fleets."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.router.config import ScoringWeights
from kvpilot.router.scoring import (
    AFFINITY,
    COLD,
    FALLBACK,
    LOAD,
    Candidate,
    ReplicaSnapshot,
    RequestShape,
    choose_cache_aware,
    choose_least_loaded,
    choose_round_robin,
    cost,
    hot_spot_cap,
    needed_blocks,
    rendezvous_weight,
)

WEIGHTS = ScoringWeights()
REQUEST = RequestShape(prompt_tokens=1100, max_output_tokens=0, tie_key=b"first-block")
FULL_HIT = 1088  # 68 blocks of 16: all a hit can cover of 1100 tokens ((1100 - 1) // 16 blocks)


def replica(
    key: str,
    queued: int = 0,
    outstanding: int = 0,
    decodes: int = 0,
    step: float = 0.0,
    rate: float = 1000.0,
    headroom: int = 1000,
) -> ReplicaSnapshot:
    return ReplicaSnapshot(
        key=key,
        block_size=16,
        queued_prefill_tokens=queued,
        outstanding_requests=outstanding,
        running_decodes=decodes,
        decode_step_seconds=step,
        prefill_tokens_per_second=rate,
        kv_headroom_blocks=headroom,
    )


def by_rendezvous(keys: list[str], tie_key: bytes = REQUEST.tie_key) -> str:
    return max(keys, key=lambda k: rendezvous_weight(tie_key, k))


def test_affinity_wins_when_the_hit_replica_is_cheap():
    candidates = [Candidate(replica("a"), FULL_HIT), Candidate(replica("b"), 0), Candidate(replica("c"), 0)]
    decision = choose_cache_aware(REQUEST, candidates, WEIGHTS)
    assert (decision.key, decision.reason, decision.cached_tokens, decision.uncached_tokens) == (
        "a",
        AFFINITY,
        1088,
        12,
    )
    assert decision.estimated_ttft_s == 12 / 1000  # physics; the cost counts own uncached tokens twice
    assert cost(candidates[0], REQUEST, WEIGHTS) == 2 * 12 / 1000
    assert decision.prefill_work_tokens == 12
    assert decision.kv_blocks == 1


def test_affinity_still_wins_while_its_queue_costs_less_than_the_miss():
    # Costs: a (2000 queued + 2 × 12) / 1000 = 2.024; b 2 × 1100 / 1000 = 2.2.
    candidates = [Candidate(replica("a", queued=2000), FULL_HIT), Candidate(replica("b"), 0)]
    decision = choose_cache_aware(REQUEST, candidates, WEIGHTS)
    assert (decision.key, decision.reason) == ("a", AFFINITY)
    assert math.isclose(decision.estimated_ttft_s, 2.012)
    # Counting the uncached tokens once (prefill=1), b's 1.1 s beats a's 2.012 s.
    assert choose_cache_aware(REQUEST, candidates, ScoringWeights(prefill=1.0)).key == "b"


def test_load_wins_when_the_hit_replicas_queue_makes_it_slower():
    # Costs: a (3000 + 2 × 12) / 1000 = 3.024; b (500 + 2 × 1100) / 1000 = 2.7; c (800 + 2200) / 1000 = 3.0.
    candidates = [
        Candidate(replica("a", queued=3000), FULL_HIT),
        Candidate(replica("b", queued=500), 0),
        Candidate(replica("c", queued=800), 0),
    ]
    decision = choose_cache_aware(REQUEST, candidates, WEIGHTS)
    assert (decision.key, decision.reason, decision.cached_tokens) == ("b", LOAD, 0)
    assert math.isclose(decision.estimated_ttft_s, 1.6)
    assert decision.prefill_work_tokens == 1600


def test_a_faster_replica_wins_on_learned_rate():
    # Same work, a prefills at 500 tok/s (2.2 s), b at 2000 tok/s (0.55 s).
    candidates = [Candidate(replica("a", rate=500.0), 0), Candidate(replica("b", rate=2000.0), 0)]
    assert choose_cache_aware(REQUEST, candidates, WEIGHTS).key == "b"


def test_replica_without_kv_headroom_is_excluded_even_with_the_whole_prefix():
    # a needs ceil((12 uncached + 64 output) / 16) = 5 blocks and has 4.
    request = RequestShape(prompt_tokens=1100, max_output_tokens=64, tie_key=b"k")
    candidates = [
        Candidate(replica("a", headroom=4), FULL_HIT),
        Candidate(replica("b", queued=100), 0),
        Candidate(replica("c"), 0),
    ]
    assert needed_blocks(candidates[0], request) == 5
    decision = choose_cache_aware(request, candidates, WEIGHTS)
    assert (decision.key, decision.reason) == ("c", LOAD)
    candidates[0] = Candidate(replica("a", headroom=5), FULL_HIT)  # exactly enough: eligible again
    assert choose_cache_aware(request, candidates, WEIGHTS).key == "a"


def test_no_replica_with_headroom_falls_back_to_the_most_headroom():
    candidates = [
        Candidate(replica("a", headroom=10), FULL_HIT),
        Candidate(replica("b", headroom=30), 0),
        Candidate(replica("c", headroom=20), 0),
    ]
    request = RequestShape(prompt_tokens=1100, max_output_tokens=1000, tie_key=b"k")  # a needs 64 blocks
    decision = choose_cache_aware(request, candidates, WEIGHTS)
    assert (decision.key, decision.reason) == ("b", FALLBACK)


def test_decode_load_breaks_an_otherwise_equal_choice():
    candidates = [Candidate(replica("a", decodes=8, step=0.05), 0), Candidate(replica("b"), 0)]
    assert choose_cache_aware(REQUEST, candidates, WEIGHTS).key == "b"
    # With the decode term weighted out, the two are tied and the rendezvous hash decides.
    no_decode = ScoringWeights(decode=0.0)
    assert choose_cache_aware(REQUEST, candidates, no_decode).key == by_rendezvous(["a", "b"])


def test_costs_within_the_tie_tolerance_go_to_the_rendezvous_winner():
    # a: 2 × 12 / 1000 = 24 ms, b: (3 + 2 × 12) / 1000 = 27 ms: 3 ms apart, inside the default 5 ms.
    candidates = [Candidate(replica("a"), FULL_HIT), Candidate(replica("b", queued=3), FULL_HIT)]
    for tie_key in (b"one", b"two", b"three", b"four"):
        request = RequestShape(1100, 0, tie_key)
        assert choose_cache_aware(request, candidates, WEIGHTS).key == by_rendezvous(["a", "b"], tie_key)
        assert choose_cache_aware(request, candidates, ScoringWeights(tie_ms=0.0)).key == "a"


def test_cold_requests_spread_by_first_block_and_stick_to_it():
    keys = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]
    candidates = [Candidate(replica(k), 0) for k in keys]
    chosen = [
        choose_cache_aware(RequestShape(500, 0, f"prefix-{i}".encode()), candidates, WEIGHTS)
        for i in range(300)
    ]
    assert {d.reason for d in chosen} == {COLD}
    counts = {k: sum(d.key == k for d in chosen) for k in keys}
    # Pinned: the weights are a wire-level agreement between router versions during a rolling update.
    assert counts == {"http://10.0.0.1:8000": 91, "http://10.0.0.2:8000": 108, "http://10.0.0.3:8000": 101}
    again = [
        choose_cache_aware(RequestShape(900, 16, f"prefix-{i}".encode()), candidates, WEIGHTS).key
        for i in range(300)
    ]
    assert again == [d.key for d in chosen]  # same first block → same replica, whatever the rest


def test_hot_spot_guard_moves_a_popular_prefix_off_an_overloaded_replica():
    # 24 outstanding over 3 replicas: cap = ceil(1.5 × 25 / 3) = 13; a (20) is a hot spot.
    hot = [
        Candidate(replica("a", outstanding=20), FULL_HIT),
        Candidate(replica("b", outstanding=2), 0),
        Candidate(replica("c", outstanding=2, queued=50), 0),
    ]
    assert hot_spot_cap(hot, WEIGHTS) == 13
    decision = choose_cache_aware(REQUEST, hot, WEIGHTS)
    assert (decision.key, decision.reason) == ("b", LOAD)
    # Below the floor (8 outstanding) affinity is never broken, however uneven the spread.
    calm = [
        Candidate(replica("a", outstanding=7), FULL_HIT),
        Candidate(replica("b"), 0),
        Candidate(replica("c"), 0),
    ]
    assert hot_spot_cap(calm, WEIGHTS) == 8
    assert choose_cache_aware(REQUEST, calm, WEIGHTS).reason == AFFINITY
    # A large balance slack switches the guard off.
    assert choose_cache_aware(REQUEST, hot, ScoringWeights(balance=1000.0)).key == "a"


def test_least_loaded_takes_fewest_outstanding_and_rotates_ties():
    candidates = [
        Candidate(replica("c", outstanding=1), 0),
        Candidate(replica("a", outstanding=3), 0),
        Candidate(replica("b", outstanding=1), 0),
    ]
    assert [choose_least_loaded(candidates, r).key for r in range(4)] == ["b", "c", "b", "c"]
    assert choose_least_loaded(candidates, 0).reason == LOAD


def test_round_robin_cycles_in_key_order():
    assert [choose_round_robin(["c", "a", "b"], r).key for r in range(4)] == ["a", "b", "c", "a"]
    assert choose_round_robin(["a"], 7).reason == FALLBACK


snapshots = st.builds(
    lambda i, queued, outstanding, decodes, rate, headroom, cached: Candidate(
        replica(f"http://r{i}:8000", queued, outstanding, decodes, 0.02, rate, headroom), cached
    ),
    st.integers(0, 10_000),
    st.integers(0, 5000),
    st.integers(0, 40),
    st.integers(0, 8),
    st.sampled_from([300.0, 1000.0, 4000.0]),
    st.integers(0, 200),
    st.sampled_from([0, 16 * 10, 16 * 60]),
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(snapshots, min_size=1, max_size=6, unique_by=lambda c: c.replica.key),
    st.binary(min_size=1),
    st.integers(0, 512),
    st.randoms(use_true_random=False),
)
def test_choice_is_order_free_within_tolerance_of_the_best_and_respects_headroom(
    candidates, tie_key, output, rng
):
    request = RequestShape(prompt_tokens=1000, max_output_tokens=output, tie_key=tie_key)
    decision = choose_cache_aware(request, candidates, WEIGHTS)
    shuffled = list(candidates)
    rng.shuffle(shuffled)
    assert choose_cache_aware(request, shuffled, WEIGHTS) == decision  # what independent routers rely on
    chosen = next(c for c in candidates if c.replica.key == decision.key)
    with_room = [c for c in candidates if c.replica.kv_headroom_blocks >= needed_blocks(c, request)]
    if not with_room:
        assert decision.reason == FALLBACK
        return
    assert chosen in with_room
    cap = hot_spot_cap(with_room, WEIGHTS)
    eligible = [c for c in with_room if c.replica.outstanding_requests < cap] or with_room
    assert chosen in eligible
    best = min(cost(c, request, WEIGHTS) for c in eligible)
    assert cost(chosen, request, WEIGHTS) <= best + WEIGHTS.tie_ms / 1000
