"""Per-replica state: what the scoring snapshot adds for requests the last /load cannot include, the
held-hash overlay, ejection and re-admission, restarts, the learned prefill rate, the /load contract."""

from __future__ import annotations

import pytest

from kvpilot.engine.kv.block_hash import block_hashes
from kvpilot.router.config import ScoringWeights
from kvpilot.router.engine_load import EngineLoad, LoadFormatError
from kvpilot.router.picker import ReplicaPicker
from kvpilot.router.prefill_rate import PrefillRateEstimator
from kvpilot.router.replica import Dispatch, Replica
from kvpilot.router.request_profile import RequestProfile
from kvpilot.router.scoring import rendezvous_weight
from kvpilot.router.sent_prompts import MAX_HELD_AGE_S, MAX_HELD_CHAINS, MAX_HELD_TOKENS

ROOT = bytes(16)
LOAD = {
    "model": "m",
    "epoch": "e1",
    "ready": True,
    "phase": "ready",
    "waiting": 2,
    "running": 3,
    "swapped": 0,
    "queued_prefill_tokens": 500,
    "running_decode_tokens": 3,
    "kv_blocks_total": 100,
    "kv_blocks_free": 60,
    "kv_blocks_cached": 10,
    "kv_blocks_reserved": 10,
    "kv_usage": 0.4,
    "block_size": 16,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 512,
    "prefill_tokens_per_second": 0.0,
    "decode_step_seconds": 0.02,
}


def load(**changes) -> EngineLoad:
    return EngineLoad.from_json({**LOAD, **changes})


def profile(tokens: int, tenant: str | None = None) -> RequestProfile:
    return RequestProfile(tenant=tenant, prompts=(list(range(tokens)),), max_output_tokens=0, extra=b"")


def synced_replica(url: str = "http://r:8000", cached: list[bytes] = ()) -> Replica:
    replica = Replica(url)
    replica.accept_load(load(), sent_at=10.0)
    replica.index.apply_snapshot(
        {
            "epoch": "e1",
            "seq": 0,
            "block_size": 16,
            "root": ROOT.hex(),
            "block_hashes": [h.hex() for h in cached],
        }
    )
    return replica


def test_snapshot_counts_only_requests_the_last_load_cannot_include():
    replica = synced_replica()
    reported = Dispatch(sent_at=9.0, prefill_work_tokens=0, uncached_tokens=300, kv_blocks=20)
    prefilling = Dispatch(sent_at=11.0, prefill_work_tokens=0, uncached_tokens=200, kv_blocks=13)
    decoding = Dispatch(
        sent_at=12.0, prefill_work_tokens=0, uncached_tokens=100, kv_blocks=7, first_byte_at=12.5
    )
    for dispatch in (reported, prefilling, decoding):
        replica.begin(dispatch)
    snap = replica.snapshot(prefill_rate=1500.0)
    assert snap.queued_prefill_tokens == 500 + 200  # the decoding one has finished its prefill
    assert snap.outstanding_requests == 2 + 3 + 2
    assert snap.running_decodes == 3 + 1
    assert snap.kv_headroom_blocks == 60 - 10 - 13 - 7
    assert snap.prefill_tokens_per_second == 1500.0
    replica.accept_load(load(), sent_at=13.0)  # now it includes all three
    snap = replica.snapshot(prefill_rate=1500.0)
    assert (snap.queued_prefill_tokens, snap.outstanding_requests) == (500, 5)


def test_sent_prompts_count_as_cached_while_in_flight_and_until_an_events_poll_confirms():
    replica = synced_replica()
    leader = profile(100)  # 6 full blocks; a hit can cover (100 - 1) // 16 = 6
    follower = RequestProfile(None, (list(range(90)) + [7] * 30,), 0, b"")  # shares 5 blocks, then differs
    assert replica.cached_tokens(follower) == 0
    dispatch = Dispatch(
        sent_at=11.0, prefill_work_tokens=0, uncached_tokens=100, kv_blocks=7, chains=replica.chains(leader)
    )
    replica.begin(dispatch)
    assert replica.cached_tokens(leader) == 96
    assert replica.cached_tokens(follower) == 80
    replica.kv_applied(sent_at=11.5)  # an events poll cannot confirm a request still in flight
    assert replica.cached_tokens(follower) == 80
    replica.first_byte(dispatch, 11.5, 200)
    replica.finish(dispatch, now=12.0)
    assert replica.cached_tokens(follower) == 80  # finished, not yet in the index
    replica.kv_applied(sent_at=11.9)  # a poll sent before the finish does not confirm it
    assert replica.cached_tokens(follower) == 80
    replica.kv_applied(sent_at=12.1)
    assert replica.cached_tokens(follower) == 0  # the index (which never got the events) is the truth now
    assert len(replica.sent) == 0


def test_a_request_that_failed_before_its_first_byte_leaves_nothing_held():
    replica = synced_replica()
    request = profile(100)
    dispatch = Dispatch(
        sent_at=11.0, prefill_work_tokens=0, uncached_tokens=100, kv_blocks=7, chains=replica.chains(request)
    )
    replica.begin(dispatch)
    replica.finish(dispatch, now=12.0)
    assert replica.cached_tokens(request) == 0 and len(replica.sent) == 0


def finish_unique(replica: Replica, count: int, tokens: int, start: float) -> list[RequestProfile]:
    """``count`` requests with prompts of ``tokens`` tokens that share no block, sent and finished one after
    another (their prefill ran), with no events poll confirming them."""
    requests = []
    for i in range(count):
        request = RequestProfile(None, (list(range(i * tokens, (i + 1) * tokens)),), 0, b"")
        sent = start + i / 1000
        dispatch = Dispatch(sent, 0, tokens, 1, chains=replica.chains(request))
        replica.begin(dispatch)
        replica.first_byte(dispatch, sent + 0.0002, 200)
        replica.finish(dispatch, now=sent + 0.0005)
        requests.append(request)
    return requests


def test_security_sent_prompts_stay_bounded_while_no_events_poll_confirms_them():
    """A replica whose /kv/* fails never confirms what it computed: the held prompts are capped (oldest go
    first), so the router's memory stays flat instead of keeping every prompt it ever sent there."""
    replica = synced_replica()
    requests = finish_unique(replica, 3000, 64, start=11.0)  # 4 blocks each, well within the token cap
    assert len(replica.sent) == MAX_HELD_CHAINS
    assert replica.cached_tokens(requests[-1]) == 48  # the newest are still held
    assert replica.cached_tokens(requests[-MAX_HELD_CHAINS]) == 48
    assert replica.cached_tokens(requests[-MAX_HELD_CHAINS - 1]) == 0
    replica.kv_applied(sent_at=1e9)  # a poll confirms what is left
    assert len(replica.sent) == 0


def test_sent_prompts_hold_a_bounded_number_of_tokens_and_only_for_a_while():
    replica = synced_replica()
    long = 16 * 1024
    requests = finish_unique(replica, 40, long, start=11.0)
    assert len(replica.sent) == MAX_HELD_TOKENS // long
    assert replica.cached_tokens(requests[-1]) == long - 16
    later = 11.0 + 1 + MAX_HELD_AGE_S
    (fresh,) = finish_unique(replica, 1, 64, start=later)
    assert len(replica.sent) == 1  # what finished more than MAX_HELD_AGE_S before is dropped
    assert replica.cached_tokens(requests[-1]) == 0 and replica.cached_tokens(fresh) == 48


def test_a_refused_request_computed_nothing_and_teaches_no_rate():
    """An engine's 4xx (or 5xx) answer is a first byte but no prefill: its prompt is not held as cached
    there, and its quick answer is not a prefill speed."""
    replica = synced_replica()
    request = profile(1000)
    for status in (400, 429, 500):
        dispatch = Dispatch(11.0, 1000, 1000, 63, chains=replica.chains(request))
        replica.begin(dispatch)
        replica.first_byte(dispatch, 11.001, status)
        assert not dispatch.computed
        replica.finish(dispatch, now=11.002)
        assert replica.cached_tokens(request) == 0 and len(replica.sent) == 0
        assert replica.rate.observed_rate is None
    dispatch = Dispatch(12.0, 1000, 1000, 63, chains=replica.chains(request))
    replica.begin(dispatch)
    replica.first_byte(dispatch, 12.5, 200)
    replica.finish(dispatch, now=13.0)
    assert dispatch.computed and replica.cached_tokens(request) == 992
    assert replica.rate.observed_rate == 2000.0


def test_a_hit_stops_at_the_first_missing_block_and_never_covers_the_last_token():
    request = profile(64)  # 4 full blocks; a hit covers at most (64 - 1) // 16 = 3
    hashes = block_hashes(request.prompts[0], 16, ROOT)
    assert synced_replica(cached=hashes).cached_tokens(request) == 48
    assert synced_replica(cached=[hashes[0], hashes[2], hashes[3]]).cached_tokens(request) == 16
    tenant = RequestProfile("acme", request.prompts, 0, extra=b"salt")
    assert synced_replica(cached=hashes).cached_tokens(tenant) == 0


@pytest.mark.parametrize(
    "held, expected_blocks",
    [
        (range(30), 30),  # the whole hittable chain (the prompt's last token is never a hit)
        (range(19), 19),  # a shared prefix across two whole runs of 8 and part of a third
        (range(16), 16),  # a prefix ending on a run's edge
        ([*range(11), *range(12, 31)], 11),  # a hole in the second run: the hit stops there
        ([*range(8), *range(9, 31)], 8),  # a hole on a run's first block
        (range(1, 31), 0),  # without the first block nothing counts
    ],
)
def test_a_long_hit_ends_exactly_at_the_first_missing_block(held, expected_blocks):
    request = profile(31 * 16 + 5)  # 31 full blocks, 31 hittable
    hashes = block_hashes(request.prompts[0], 16, ROOT)
    replica = synced_replica(cached=[hashes[i] for i in held])
    assert replica.cached_tokens(request) == expected_blocks * 16


def test_a_sent_prompt_extends_a_hit_past_what_the_index_holds():
    request = profile(31 * 16 + 5)
    hashes = block_hashes(request.prompts[0], 16, ROOT)
    replica = synced_replica(cached=hashes[:19])
    shorter = profile(26 * 16)  # the same tokens, 26 full blocks, sent there just now
    replica.begin(
        Dispatch(
            sent_at=11.0,
            prefill_work_tokens=0,
            uncached_tokens=0,
            kv_blocks=0,
            chains=replica.chains(shorter),
        )
    )
    assert replica.cached_tokens(request) == 26 * 16


def test_ejection_lasts_until_a_poll_sent_after_it_finds_the_replica_ready():
    replica = synced_replica()
    assert replica.routable
    assert replica.eject("error", now=20.0) is True
    assert replica.eject("timeout", now=20.5) is False  # already out: counted once
    replica.accept_load(load(), sent_at=19.0)  # answered late, but sent before the failure
    assert not replica.routable and replica.eject_reason == "timeout"
    replica.accept_load(load(ready=False), sent_at=21.0)
    assert not replica.routable
    replica.accept_load(load(), sent_at=22.0)
    assert replica.routable and replica.eject_reason is None


def test_a_new_epoch_forgets_the_cache_and_the_measured_rates():
    replica = synced_replica(cached=[b"\x01" * 16])
    replica.accept_load(load(prefill_tokens_per_second=800.0), sent_at=11.0)
    replica.rate.observe(1000, 0.5)
    replica.accept_load(load(epoch="e2"), sent_at=12.0)
    assert (replica.index.synced, replica.index.hashes, replica.rate.rate()) == (False, set(), None)


def test_prefill_rate_prefers_the_engine_then_learns_from_first_bytes():
    rate = PrefillRateEstimator(smoothing=0.5, min_sample_tokens=256)
    assert rate.rate() is None
    rate.observe(100, 0.01)  # too little work to say anything about prefill speed
    assert rate.rate() is None
    rate.observe(1000, 1.0)
    rate.observe(2000, 1.0)
    assert rate.rate() == 1500.0  # 1000, then halfway to 2000
    rate.report_engine(0.0)  # "not measured yet" never overrides
    assert rate.rate() == 1500.0
    rate.report_engine(3000.0)
    assert rate.rate() == 3000.0


def test_the_fleet_rate_covers_replicas_that_have_not_measured_yet():
    picker = ReplicaPicker("cache_aware", ScoringWeights(), prefill_rate_prior=2000.0)
    fresh, measured = synced_replica("http://a:1"), synced_replica("http://b:1")
    assert picker.fleet_prefill_rate([fresh, measured]) == 2000.0
    measured.accept_load(load(prefill_tokens_per_second=600.0), sent_at=11.0)
    assert picker.fleet_prefill_rate([fresh, measured]) == 600.0
    assert picker.prefill_rates([fresh, measured]) == [600.0, 600.0]


def fleet_with_rates(rates: list[float]) -> list[Replica]:
    replicas = []
    for i, rate in enumerate(rates):
        replica = synced_replica(f"http://r{i}:1")
        replica.accept_load(
            load(
                prefill_tokens_per_second=rate,
                queued_prefill_tokens=0,
                waiting=0,
                running=0,
                running_decode_tokens=0,
            ),
            sent_at=11.0,
        )
        replicas.append(replica)
    return replicas


def test_every_replica_is_costed_at_the_fleet_median_unless_per_replica_rates_are_asked_for():
    replicas = fleet_with_rates([300.0, 200.0, 250.0, 0.0])  # the last has not measured one yet
    assert ReplicaPicker("cache_aware", ScoringWeights(), 2000.0).prefill_rates(replicas) == [250.0] * 4
    per_replica = ReplicaPicker("cache_aware", ScoringWeights(), 2000.0, per_replica_rate=True)
    assert per_replica.prefill_rates(replicas) == [300.0, 200.0, 250.0, 250.0]
    even = fleet_with_rates([300.0, 200.0, 250.0, 100.0])
    assert ReplicaPicker("cache_aware", ScoringWeights(), 2000.0).fleet_prefill_rate(even) == 225.0


def test_a_replica_measured_under_load_does_not_draw_cold_requests_away_from_idle_peers():
    # r0 served the first tenant: its engine measured batched prefill steps (360 tok/s) and it still has
    # 278 tokens queued; r1 and r2 only prefilled their short warm-up prompts (200 tok/s). A new tenant's
    # 700-token prompt is cheaper on an idle replica: per-replica rates said r0 ((278 + 1400) / 360 = 4.66 s
    # against 1400 / 200 = 7 s), which is how the first tenants all piled onto one replica.
    replicas = fleet_with_rates([360.0, 200.0, 200.0])
    replicas[0].accept_load(
        load(
            prefill_tokens_per_second=360.0,
            queued_prefill_tokens=278,
            waiting=1,
            running=1,
            running_decode_tokens=0,
        ),
        sent_at=11.0,
    )
    cold = profile(700)
    fleet = ReplicaPicker("cache_aware", ScoringWeights(), 2000.0)
    chosen, decision = fleet.pick(replicas, cold)
    idle_winner = max(
        ("http://r1:1", "http://r2:1"), key=lambda url: rendezvous_weight(cold.tie_key(16), url)
    )
    assert (chosen.url, decision.reason) == (idle_winner, "cold")  # the idle pair ties: the hash picks
    mixed = ReplicaPicker("cache_aware", ScoringWeights(), 2000.0, per_replica_rate=True)
    assert mixed.pick(replicas, cold)[0].url == "http://r0:1"


@pytest.mark.parametrize(
    "change",
    [
        {"ready": "yes"},
        {"waiting": -1},
        {"block_size": 0},
        {"epoch": None},
        {"prefill_tokens_per_second": float("nan")},
        {"running": True},
    ],
)
def test_a_load_body_that_breaks_the_contract_is_refused(change):
    with pytest.raises(LoadFormatError):
        EngineLoad.from_json({**LOAD, **change})
    with pytest.raises(LoadFormatError):
        EngineLoad.from_json([LOAD])
