"""The request state machine and the single idempotent reclaim routine
(docs/architecture.md#request-state-machine, #terminal-reclaim)."""

from __future__ import annotations

import random
import time

import pytest
from engine_device import ENGINE_DEVICE

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.request_validation import RequestError
from kvpilot.engine.sequence import TERMINAL, TRANSITIONS, IllegalTransition, Sequence, SequenceStatus

S = SequenceStatus


def test_legal_path_and_illegal_transitions_raise():
    r = Sequence("x", [1, 2], SamplingParams())
    for nxt in (
        S.RUNNABLE,
        S.PREFILL,
        S.DECODE,
        S.BACKPRESSURED,
        S.DECODE,
        S.PREEMPTED,
        S.RUNNABLE,
        S.PREFILL,
        S.DECODE,
        S.FINISHED,
    ):
        r.transition(nxt)
    with pytest.raises(IllegalTransition):
        r.transition(S.DECODE)  # nothing leaves a terminal state
    q = Sequence("y", [1], SamplingParams())
    with pytest.raises(IllegalTransition):
        q.transition(S.DECODE)  # a queued request has no blocks to decode with
    with pytest.raises(IllegalTransition):
        q.transition(S.FINISHED)  # queued requests end by cancel / timeout / failure / rejection only
    assert all(not TRANSITIONS[t] for t in TERMINAL)
    assert all(
        S.CANCELLED in TRANSITIONS[s] and S.TIMED_OUT in TRANSITIONS[s] for s in S if s not in TERMINAL
    )


@pytest.fixture(scope="module")
def llm():
    return LLM(
        "tiny-random",
        num_kv_blocks=40,
        block_size=4,
        max_num_seqs=6,
        max_num_batched_tokens=24,
        **ENGINE_DEVICE,
    )


def test_cancel_and_timeout_racing_leave_one_record_and_no_double_free(llm):
    engine = llm.engine
    engine.add_request("race", list(range(10, 30)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.abort_request("race", S.CANCELLED)
    assert not engine.abort_request("race", S.TIMED_OUT)  # second signal: a no-op
    engine.check_invariants()
    assert [r.request_id for r in engine.terminal_records].count("race") == 1
    assert engine.terminal_records[-1].status == "cancelled"
    assert engine.pool.num_in_use == 0


def test_queued_request_times_out_by_its_deadline(llm):
    engine = llm.engine
    engine.add_request("late", [5, 6, 7], SamplingParams(max_tokens=4), deadline=time.monotonic() - 1)
    outs = {o.request_id: o for o in engine.step()}
    assert outs["late"].finished and outs["late"].outputs[0].finish_reason == "timeout"
    assert engine.terminal_records[-1].status == "timed_out" and engine.kv.num_reserved_blocks == 0


@pytest.mark.parametrize("seed", range(8))
def test_random_cancels_and_timeouts_never_leak_or_double_free(llm, seed):
    """Random arrivals (some with n > 1), cancels and expiring deadlines at random steps: invariants after
    every step, every block free or cached at the end, exactly one terminal record per request."""
    engine = llm.engine
    rng = random.Random(seed)
    before = len(engine.terminal_records)
    ids: list[str] = []
    for i in range(rng.randint(6, 14)):
        rid = f"s{seed}-{i}"
        n = rng.choice([1, 1, 2, 3])
        deadline = time.monotonic() + rng.choice([0.0, 0.05]) if rng.random() < 0.3 else None
        engine.add_request(
            rid,
            [rng.randrange(3, 500) for _ in range(rng.randint(1, 20))],
            SamplingParams(n=n, temperature=1.0, seed=i, max_tokens=rng.randint(1, 12)),
            deadline=deadline,
        )
        ids.append(rid)
    steps = 0
    while engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 2)):
            victim = rng.choice(ids)
            status = rng.choice([S.CANCELLED, S.TIMED_OUT, S.FAILED])
            engine.abort_request(victim, status)
            engine.abort_request(victim, S.CANCELLED)  # racing second signal
        engine.step()
        engine.check_invariants()
        steps += 1
        assert steps < 500
    records = [r.request_id for r in engine.terminal_records[before:]]
    assert sorted(records) == sorted(ids)
    assert engine.pool.num_in_use == 0 and engine.kv.num_reserved_blocks == 0
    assert engine.scheduler.num_unfinished == 0 and not engine.sequences


def test_request_ids_in_use_or_reserved_are_refused():
    engine = LLM("tiny-random", num_kv_blocks=16).engine
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2))
    for rid in ("a", "admission-probe"):  # the second is the id admission_cost prices with, then forgets
        with pytest.raises(RequestError, match=f"request id '{rid}' is already in use"):
            engine.add_request(rid, [5, 6, 7], SamplingParams(max_tokens=2))
    assert engine.admission_cost([5, 6, 7], SamplingParams(max_tokens=2)) >= 1
    assert set(engine.sequences) == {"a"}
