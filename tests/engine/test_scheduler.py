"""Scheduler behaviour from the engine's own scheduler, with the model replaced by a unit-cost stub:
completion ticks of static vs continuous batching (docs/architecture.md#scheduling), priorities, preemption
victims with exact block ids, two-phase admission, and a randomized property test of the KV invariants."""

from __future__ import annotations

import random

import pytest
import torch

from kvpilot.engine import LLMEngine, SamplingParams
from kvpilot.engine.engine_args import EngineArgs
from kvpilot.engine.sequence import SequenceStatus


def stub_engine(monkeypatch_logits=None, **args) -> LLMEngine:
    """A real engine (scheduler, KV manager, sampler, reclaim) whose forward pass is a unit-cost stub:
    each step is one tick, and the stub's logits favour token 7 (never EOS) unless given a function."""
    engine = LLMEngine(EngineArgs.from_kwargs(model="tiny-random", **args).create_config())
    vocab = engine.arch.vocab_size

    def execute(batch):
        n = len(batch.sampling_sequences)
        if monkeypatch_logits is not None:
            return monkeypatch_logits(batch)
        logits = torch.zeros(n, vocab)
        logits[:, 7] = 1.0
        return logits

    engine.runner.execute = execute
    return engine


def completion_ticks(engine: LLMEngine, check=True) -> dict[str, int]:
    done: dict[str, int] = {}
    tick = 0
    while engine.has_unfinished_requests():
        tick += 1
        for out in engine.step():
            if out.finished:
                done[out.request_id] = tick
        if check:
            engine.check_invariants()
    return done


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("static", {"A": 1, "B": 4, "C": 5}),
        ("continuous", {"A": 1, "C": 2, "B": 4}),
    ],
)
def test_static_vs_continuous_completion_ticks(mode, expected):
    engine = stub_engine(max_num_seqs=2, batching_mode=mode, num_kv_blocks=32, block_size=4)
    for rid, n in (("A", 1), ("B", 4), ("C", 1)):
        engine.add_request(rid, [11, 12, 13], SamplingParams(temperature=0, max_tokens=n))
    ticks = completion_ticks(engine)
    assert ticks == expected
    assert list(ticks) == list(expected)  # completion order too
    # slot utilisation: 6 serviced tokens / (capacity 2 × makespan)
    assert 6 / (2 * max(ticks.values())) == pytest.approx(0.60 if mode == "static" else 0.75)


def test_equal_lengths_make_static_and_continuous_tie():
    results = []
    for mode in ("static", "continuous"):
        engine = stub_engine(max_num_seqs=2, batching_mode=mode, num_kv_blocks=32, block_size=4)
        for rid in ("A", "B"):
            engine.add_request(rid, [5, 6], SamplingParams(temperature=0, max_tokens=3))
        results.append(completion_ticks(engine))
    assert results[0] == results[1] == {"A": 3, "B": 3}


def test_priority_orders_the_queue_fcfs_within_a_priority():
    engine = stub_engine(max_num_seqs=1, num_kv_blocks=32, block_size=4)
    for rid, prio in (("low-1", 5), ("high-1", 0), ("low-2", 5), ("high-2", 0)):
        engine.add_request(rid, [3, 4], SamplingParams(temperature=0, max_tokens=1), priority=prio)
    assert list(completion_ticks(engine)) == ["high-1", "high-2", "low-1", "low-2"]


def test_recompute_preemption_picks_lowest_priority_latest_arrival_with_exact_blocks():
    # 7 usable blocks of 4 tokens. Three requests of 8 prompt tokens take 3 × 2 blocks + growth.
    engine = stub_engine(num_kv_blocks=8, block_size=4, enable_prefix_caching=False, max_num_seqs=4)
    p = SamplingParams(temperature=0, max_tokens=6)
    engine.add_request("a", list(range(10, 18)), p, arrival_time=1.0)
    engine.add_request("b", list(range(20, 28)), p, arrival_time=2.0)
    engine.add_request("c", list(range(30, 38)), p, arrival_time=3.0)
    engine.step()  # prefill all three: 6 blocks, first tokens sampled
    tables = {r: list(engine.kv.block_table(engine.sequences[r])) for r in "abc"}
    assert tables == {"a": [1, 2], "b": [3, 4], "c": [5, 6]}
    engine.step()  # 9th token of each: a takes block 7, b has none left -> c (latest) is preempted
    assert engine.sequences["c"].status is SequenceStatus.PREEMPTED
    assert engine.sequences["c"].num_computed_tokens == 0
    assert engine.kv.block_table(engine.sequences["a"]) == [1, 2, 7]
    # c's blocks were freed tail first (6 then 5), so b got 6
    assert engine.kv.block_table(engine.sequences["b"]) == [3, 4, 6]
    assert engine.scheduler.num_preemptions == 1
    engine.check_invariants()
    ticks = completion_ticks(engine)
    assert set(ticks) == {"a", "b", "c"}
    assert engine.pool.num_in_use == 0


def test_waiting_requests_hold_a_reservation_until_scheduled():
    engine = stub_engine(num_kv_blocks=64, block_size=4, max_num_seqs=1)
    engine.add_request("a", list(range(3, 13)), SamplingParams(temperature=0, max_tokens=2))
    engine.add_request("b", list(range(3, 9)), SamplingParams(temperature=0, max_tokens=2))
    # prompt 10 tokens + 1 → 3 blocks; prompt 6 + 1 → 2 blocks
    assert engine.kv.num_reserved_blocks == 5
    headroom_before = engine.kv.admission_headroom()
    engine.step()  # a scheduled: its reservation turns into 3 physical blocks
    assert engine.kv.num_reserved_blocks == 2
    assert engine.kv.admission_headroom() == headroom_before  # promised 3, took 3
    engine.abort_request("b")  # cancelled while queued: only the reservation rolls back
    assert engine.kv.num_reserved_blocks == 0
    assert engine.terminal_records[-1].status == "cancelled"


def test_chunked_prefill_lets_decodes_flow():
    engine = stub_engine(num_kv_blocks=128, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    engine.add_request("short", [3, 4], SamplingParams(temperature=0, max_tokens=5))
    engine.step()
    engine.add_request("long", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=1))
    out = engine.scheduler.schedule()
    # one decode token for "short" and a 7-token chunk of "long" share the 8-token budget
    assert [(r.seq_id, n) for r, n in out.scheduled] == [("short", 1), ("long", 7)]


def test_decodes_take_their_tokens_before_an_earlier_prefill_chunk():
    """A higher-priority prefill ahead of a decode in the running order cannot take the whole budget."""
    engine = stub_engine(num_kv_blocks=128, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    engine.add_request("decoding", [3, 4], SamplingParams(temperature=0, max_tokens=6), priority=1)
    engine.step()
    engine.add_request("urgent", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=1), priority=0)
    engine.step()  # urgent admitted behind the decode with the rest of the budget; now it runs first
    for _ in range(3):
        engine.step()
        assert [(rid, n) for rid, _, n in engine.last_step_scheduled] == [("decoding", 1), ("urgent", 7)]


def test_parallel_samples_count_against_max_num_seqs_at_admission():
    engine = stub_engine(num_kv_blocks=128, block_size=4, max_num_seqs=4)
    engine.add_request("single", [3, 4, 5], SamplingParams(temperature=0, max_tokens=4))
    engine.add_request("four", [6, 7, 8], SamplingParams(n=4, temperature=1.0, max_tokens=2))
    most = 0
    admitted_at = None
    for tick in range(1, 20):
        engine.step()
        engine.check_invariants()
        most = max(most, len(engine.scheduler.running))
        if admitted_at is None and "four#1" in engine.sequences:
            admitted_at = tick
        if not engine.has_unfinished_requests():
            break
    assert most == 4  # never more sequences than max_num_seqs, forks included
    assert admitted_at == 5  # "four" waited until "single" (4 tokens) had finished
    with pytest.raises(ValueError, match=r"best_of=5 exceeds the server's max_num_seqs \(4\)"):
        engine.add_request("five", [3], SamplingParams(n=2, best_of=5))


@pytest.mark.parametrize(("fraction", "preempts"), [(0.0, True), (0.5, True), (1.0, False)])
def test_reserved_output_fraction_trades_concurrency_for_preemptions(fraction, preempts):
    """11 usable blocks of 4 tokens; three requests of 8 prompt + 8 output tokens need 4 blocks each at the
    end. Starting all three (fraction 0) must preempt; keeping every running output's share free (1.0)
    starts the third only when it fits, and nothing is preempted."""
    engine = stub_engine(
        num_kv_blocks=12,
        block_size=4,
        max_num_seqs=4,
        enable_prefix_caching=False,
        reserved_output_fraction=fraction,
    )
    for i in range(3):
        engine.add_request(
            f"r{i}",
            list(range(10 * i + 3, 10 * i + 11)),
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        )
    engine.step()
    started = len(engine.scheduler.running)
    ticks = completion_ticks(engine)
    assert set(ticks) == {"r0", "r1", "r2"} and engine.pool.num_in_use == 0
    assert (engine.scheduler.num_preemptions > 0) is preempts
    assert started == (2 if fraction == 1.0 else 3)


def test_reserved_output_fraction_is_validated():
    with pytest.raises(ValueError, match=r"reserved_output_fraction must be in \[0, 1\], got 1.5"):
        EngineArgs(model="tiny-random", reserved_output_fraction=1.5).create_config()


def test_prompt_longer_than_budget_without_chunking_is_refused():
    engine = stub_engine(
        num_kv_blocks=64, block_size=4, max_num_batched_tokens=8, max_num_seqs=4, enable_chunked_prefill=False
    )
    with pytest.raises(ValueError, match="chunked prefill disabled"):
        engine.add_request("x", list(range(3, 20)), SamplingParams())


@pytest.mark.parametrize("seed", range(12))
def test_randomized_scheduler_keeps_kv_invariants(seed):
    """Random arrivals, lengths, budgets, pool sizes, priorities, EOS stops, cancels and preemption mode:
    invariants hold after every step; at the end every block is free or cached and every request left
    exactly one terminal record."""
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    args = dict(
        num_kv_blocks=rng.randint(8, 30),
        block_size=block_size,
        max_num_batched_tokens=rng.choice([8, 16, 64]),
        max_num_seqs=rng.randint(1, 6),
        enable_prefix_caching=rng.random() < 0.7,
        enable_chunked_prefill=True,
        preemption_mode=rng.choice(["recompute", "swap"]),
        swap_space=0.001,
    )
    gen = torch.Generator().manual_seed(seed)

    def random_logits(batch):
        return torch.randn(len(batch.sampling_sequences), 512, generator=gen) * 3

    engine = stub_engine(random_logits, **args)
    capacity = (args["num_kv_blocks"] - 1) * block_size
    prefixes = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    pending = []
    for i in range(rng.randint(5, 20)):
        body = rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randint(0, 10))]
        max_tokens = rng.randint(1, 24)
        body = body[: max(1, capacity - max_tokens - 1)]
        pending.append((rng.randint(0, 15), f"r{i}", body, max_tokens, rng.randint(0, 2)))
    pending.sort()
    submitted, tick = [], 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= tick:
            _, rid, body, mt, prio = pending.pop(0)
            engine.add_request(rid, body, SamplingParams(temperature=1.0, max_tokens=mt), priority=prio)
            submitted.append(rid)
        if submitted and rng.random() < 0.08:
            engine.abort_request(rng.choice(submitted))  # may hit a finished one: must be a no-op
        engine.step()
        engine.check_invariants()
        tick += 1
        assert tick < 2000, "engine made no progress"
    assert engine.pool.num_in_use == 0
    assert engine.pool.num_free == engine.pool.num_usable
    records = [r.request_id for r in engine.terminal_records]
    assert sorted(records) == sorted(submitted)  # exactly one terminal record each
    if engine.kv.swap is not None:
        assert engine.kv.swap.num_free == engine.kv.swap.num_blocks


@pytest.mark.parametrize("seed", range(6))
def test_randomized_forks_swaps_and_releases_leave_no_kv_state(seed):
    """Random parallel samples (forks, copy-on-write), beams, admission probes, cancels, EOS stops and
    both preemption modes on a small pool: invariants hold after every step, including that no released
    sequence keeps anything in the KV manager; at the end it holds nothing at all."""
    rng = random.Random(1000 + seed)
    args = dict(
        num_kv_blocks=rng.randint(8, 16),
        block_size=rng.choice([2, 4]),
        max_num_batched_tokens=rng.choice([8, 16, 64]),
        max_num_seqs=rng.randint(2, 8),
        enable_prefix_caching=rng.random() < 0.7,
        enable_chunked_prefill=True,
        preemption_mode=["recompute", "swap"][seed % 2],
        swap_space=0.001,
    )
    gen = torch.Generator().manual_seed(seed)
    engine = stub_engine(
        lambda batch: torch.randn(len(batch.sampling_sequences), 512, generator=gen) * 3, **args
    )
    prefix = [rng.randrange(3, 500) for _ in range(6)]
    submitted = []
    for _ in range(400):
        if len(submitted) < 14 and rng.random() < 0.3:
            body = prefix[: rng.randint(0, 6)] + [rng.randrange(3, 500) for _ in range(rng.randint(1, 8))]
            if rng.random() < 0.2:
                params = SamplingParams(use_beam_search=True, beam_width=2, n=2, max_tokens=rng.randint(1, 6))
            else:
                params = SamplingParams(n=rng.randint(1, 3), temperature=1.0, max_tokens=rng.randint(1, 10))
            engine.admission_cost(body, params)  # a probe leaves nothing behind
            rid = f"r{len(submitted)}"
            engine.add_request(rid, body, params)
            submitted.append(rid)
        if submitted and rng.random() < 0.05:
            engine.abort_request(rng.choice(submitted))
        engine.step()
        engine.check_invariants()
        if len(submitted) == 14 and not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests(), "engine made no progress"
    assert not engine.kv.sequence_ids and not engine.kv.tables and engine.kv.num_reserved_blocks == 0
    assert engine.pool.num_in_use == 0
    if engine.kv.swap is not None:
        assert engine.kv.swap.num_free == engine.kv.swap.num_blocks


def _run_to_the_end(engine, requests, steps: int = 600) -> dict[str, list[list[int]]]:
    """Add ``(request id, prompt, params[, arrival step])`` (arrival 0 by default) and step until every
    request ended (a bounded number of steps: a stuck engine fails here instead of hanging); each
    request's outputs' token ids."""
    last_arrival = max((r[3] for r in requests if len(r) > 3), default=0)
    done: dict[str, list[list[int]]] = {}
    for step in range(steps):
        for rid, prompt, params, *arrival in requests:
            if (arrival[0] if arrival else 0) == step:
                engine.add_request(rid, prompt, params)
        if step >= last_arrival and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
        engine.check_invariants()
    assert not engine.has_unfinished_requests(), "stuck: a request never ends"
    assert engine.pool.num_in_use == 0
    return done


def _tiny(**args):
    from engine_device import ENGINE_DEVICE

    from kvpilot.engine import LLM

    return LLM("tiny-random", **args, **ENGINE_DEVICE).engine


def test_a_preempted_sequence_recomputes_in_chunks_without_chunked_prefill():
    """Its prompt and output together (17 tokens) exceed the budget (8): with chunking off it waited for a
    step that could take them all at once, which never comes (every later step was empty)."""
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=20)
    requests = [("a", [5, 6, 7, 8], params), ("b", [9, 10, 11, 12], params)]
    small = dict(enable_chunked_prefill=False, max_num_batched_tokens=8, max_num_seqs=2, block_size=4)
    engine = _tiny(num_kv_blocks=9, **small)
    done = _run_to_the_end(engine, requests)
    assert engine.scheduler.num_preemptions >= 1
    assert done == _run_to_the_end(_tiny(num_kv_blocks=64, **small), requests)


BEAM_PROMPT = [168, 340, 3, 395, 110, 463, 268, 460, 393, 503, 161, 327, 80, 303]


@pytest.mark.parametrize(
    ("engine_args", "extra"),
    [
        ({}, {"prompt_logprobs": 1}),  # prompt logprobs skip the prefix cache: the recompute needs new blocks
        ({"enable_prefix_caching": False}, {}),
        ({"enable_prefix_caching": False, "preemption_mode": "swap", "swap_space": 0.01}, {}),
    ],
    ids=["prompt-logprobs", "no-prefix-caching", "swap"],
)
def test_beam_search_goes_on_when_a_preempted_beam_needs_its_siblings_blocks(engine_args, extra):
    """A beam preempted while its sibling, resident and unscheduled, waits for its distribution could not
    come back: the blocks it needed were the sibling's, which nothing freed (every step empty, forever).
    The idle sibling now leaves the cache too, and the beams are the unpreempted run's."""
    requests = [
        ("r0", [396], SamplingParams(max_tokens=16)),
        ("r1", BEAM_PROMPT, SamplingParams(use_beam_search=True, beam_width=2, **extra)),
    ]
    engine = _tiny(block_size=4, num_kv_blocks=14, max_num_seqs=4, **engine_args)
    done = _run_to_the_end(engine, requests)
    assert engine.scheduler.num_preemptions >= 1
    roomy = _run_to_the_end(_tiny(block_size=4, num_kv_blocks=64, max_num_seqs=4, **engine_args), requests)
    assert done["r1"] == roomy["r1"]


def test_static_batching_lets_a_preempted_beam_back_into_its_own_batch():
    """Static batching admitted waiting sequences only once nothing ran, and a preempted beam's siblings
    (waiting for it) counted as running: neither could move."""
    other = [405, 85, 211, 372, 194, 291, 335, 399, 208, 132, 413, 464, 415, 172, 253, 203, 157, 260]
    requests = [
        ("beams", [378, 461, 316, 477], SamplingParams(use_beam_search=True, beam_width=3)),
        ("other", [*other, 446, 280, 173, 364, 114, 421, 53, 468, 161, 67, 260, 97, 40], SamplingParams()),
    ]
    engine = _tiny(block_size=4, num_kv_blocks=20, max_model_len=52, batching_mode="static")
    engine.add_request(*requests[1], priority=-1)
    done = _run_to_the_end(engine, requests[:1])
    assert engine.scheduler.num_preemptions >= 1 and len(done["beams"]) == 1


def _beam_mix(seed: int) -> tuple[dict, list[tuple[str, list[int], SamplingParams, int]]]:
    """Swap preemption on a cache of 8-16 blocks of 4: two to four requests, about half of them beam
    searches, arriving over the first steps (request id, prompt, params, arrival step)."""
    rng = random.Random(seed)
    cfg = dict(
        block_size=4,
        num_kv_blocks=rng.choice([9, 11, 13, 17]),
        max_num_seqs=4,
        preemption_mode="swap",
        swap_space=0.01,
        max_num_batched_tokens=rng.choice([8, 12, 16]),
        enable_prefix_caching=rng.random() < 0.5,
    )
    requests = []
    for i in range(rng.randint(2, 4)):
        beam = rng.random() < 0.5
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, 20))]
        params = (
            SamplingParams(use_beam_search=True, beam_width=rng.choice([2, 3]), max_tokens=rng.randint(3, 12))
            if beam
            else SamplingParams(temperature=0, max_tokens=rng.randint(3, 20), ignore_eos=True)
        )
        requests.append((f"q{i}", prompt, params, rng.randint(0, 3)))
    return cfg, requests


@pytest.mark.parametrize("seed", [1, 21, 28, 29, 39, 49, 72, 86])
def test_beams_waiting_for_a_swapped_or_preempted_sibling_never_stall_the_engine(seed):
    """Each of these mixes stalled before (every step empty): resident beams that had reported held the
    blocks their out-of-cache sibling, or another request swapped out, needed to come back. Every request
    now ends, with the outputs of a run whose cache never preempts."""

    cfg, requests = _beam_mix(seed)
    assert _run_to_the_end(_tiny(**cfg), requests) == _run_to_the_end(
        _tiny(**{**cfg, "num_kv_blocks": 256}), requests
    )


def test_drafts_of_unscheduled_sequences_are_dropped_before_anyone_is_preempted():
    # A draft model's proposer grows a sequence's table for its drafts before the schedule. When an
    # earlier sequence then needs a block, those draft slots go first: nobody is preempted for it.
    engine = stub_engine(num_kv_blocks=7, block_size=2, enable_prefix_caching=False, max_num_seqs=4)
    p = SamplingParams(temperature=0, max_tokens=8)
    engine.add_request("a", [10, 11, 12, 13], p, arrival_time=1.0)
    engine.add_request("b", [20, 21, 22, 23], p, arrival_time=2.0)
    engine.step()  # prefill: 2 blocks each, one token sampled; each next token needs a third block
    a, b = engine.sequences["a"], engine.sequences["b"]
    b.spec_token_ids = [7, 7, 7]  # what propose_drafts leaves: drafts and the slots they write
    assert engine.kv.allocate(b, 1 + len(b.spec_token_ids))
    assert engine.pool.num_free == 0
    out = engine.scheduler.schedule()
    assert out.preempted == []
    assert b.spec_token_ids == []
    assert [(r.seq_id, n) for r, n in out.scheduled] == [(a.seq_id, 1), (b.seq_id, 1)]
    assert len(engine.kv.block_table(a)) == len(engine.kv.block_table(b)) == 3
