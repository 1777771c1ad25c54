"""The persistent batch equals a rebuild from scratch after every step
(docs/architecture.md#persistent-batch).

The block-table tensor must hold exactly the KV manager's lists (rows by slot, zeros past each table, slots
reused lowest first, growing when full); the per-slot token ids and sampling parameters must be the
sequences' own; and every step's flat batch (token ids, positions, slots, query offsets, lengths, padded
block tables, logits rows) and sampling tensors must equal what a per-token reference computes from the
requests and their block tables. A property test drives an engine through random joins, leaves (finishes,
aborts), backpressure, preemption (recompute and swap), prefix-cache hits, chunked prefill, n > 1 forks and
beam search, checking all of it at every step, with and without asynchronous scheduling (a step's inputs
then include tokens still in flight, read from the last step's sampled ids).
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_device import ENGINE_DEVICE
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.kv.block_table import BlockTableTensor
from kvpilot.engine.sampling.row_params import SamplingTensors

CPU = torch.device("cpu")


# ---- the block-table tensor ----------------------------------------------------------------------------
def test_block_table_tensor_writes_rows_and_reuses_the_lowest_slot():
    bt = BlockTableTensor(2, 3, CPU)
    assert bt.assign("a", [5, 6]) == 0 and bt.assign("b", []) == 1
    bt.append("b", [7])
    bt.append("a", [8])
    bt.replace("a", 1, 9)
    bt.check({"a": [5, 9, 8], "b": [7]})
    bt.drop("a")
    assert bt.host[0].tolist() == [0, 0, 0]
    assert bt.assign("c", [4]) == 0  # the freed slot, lowest first
    bt.assign("d", [1, 2])  # past the capacity: the table doubles
    bt.append("d", [3, 10])  # past the width: it grows
    assert bt.capacity == 4 and bt.width >= 4
    tables = {"b": [7], "c": [4], "d": [1, 2, 3, 10]}
    bt.check(tables)
    bt.host[bt.slot_of["d"], 3] = 11  # negative control: one wrong element is found
    with pytest.raises(AssertionError, match="differs"):
        bt.check(tables)


# ---- the per-step reference ----------------------------------------------------------------------------
def reference_batch(engine, scheduled, in_flight=None) -> dict[str, list]:
    """The flat batch, token by token, from the requests and the KV manager's lists (a token still in flight,
    under asynchronous scheduling, from the last step's sampled ids)."""
    bs = engine.kv.block_size
    ref: dict[str, list] = {
        "ids": [],
        "pos": [],
        "slots": [],
        "qsl": [0],
        "lens": [],
        "rows": [],
        "prompt": [],
    }
    for req, n in scheduled:
        c, table = req.num_computed_tokens, engine.kv.block_table(req)
        for p in range(c, c + n):
            known = p < req.num_tokens
            ref["ids"].append(req.all_token_ids[p] if known else int(in_flight[req.pending_row]))
            ref["pos"].append(p)
            ref["slots"].append(table[p // bs] * bs + p % bs)
        start = ref["qsl"][-1]
        ref["qsl"].append(start + n)
        ref["lens"].append(c + n)
        if c + n >= req.num_tokens_ahead:
            ref["rows"].append(start + n - 1)
        if req.params.prompt_logprobs is not None and req.num_output_tokens == 0:
            ref["prompt"].extend(range(start, start + max(0, min(c + n, req.num_prompt_tokens - 1) - c)))
    width = max(len(engine.kv.block_table(r)) for r, _ in scheduled)
    ref["tables"] = [
        engine.kv.block_table(r) + [0] * (width - len(engine.kv.block_table(r))) for r, _ in scheduled
    ]
    ref["rows"] += ref.pop("prompt")
    return ref


def checked(engine) -> dict[str, int]:
    """Wrap the engine's batch building so every step's batch and sampling tensors are compared with the
    references; returns counters of what the steps went through."""
    seen = {"steps": 0, "prefill_chunks": 0, "sampling_rows": 0}
    runner, batch = engine.runner, engine.runner.input_batch
    build, sampling_tensors = runner.build_batch, batch.sampling_tensors

    def build_checked(scheduled, in_flight=None):
        ref = reference_batch(engine, scheduled, in_flight)
        out = build(scheduled, in_flight)
        got = {
            "ids": out.input_ids.tolist(),
            "pos": out.positions.tolist(),
            "slots": out.meta.slot_mapping.tolist(),
            "qsl": out.meta.query_start_loc.tolist(),
            "lens": out.meta.seq_lens.tolist(),
            "rows": out.logits_indices.tolist(),
            "tables": out.meta.block_tables.tolist(),
        }
        assert got == ref
        assert out.input_ids.dtype == out.positions.dtype == out.meta.slot_mapping.dtype == torch.int64
        assert out.meta.block_tables.dtype == out.meta.seq_lens.dtype == torch.int32
        assert out.meta.num_decodes == next(
            (i for i, (_, n) in enumerate(scheduled) if n != 1), len(scheduled)
        )
        seen["steps"] += 1
        seen["prefill_chunks"] += sum(1 for r, n in scheduled if n > 1 and r.num_computed_tokens > 0)
        return out

    def tensors_checked(seqs):
        out = sampling_tensors(seqs)
        assert torch.equal(
            out.values.cpu(), SamplingTensors.from_params([s.params for s in seqs], CPU).values
        )
        seen["sampling_rows"] += len(seqs)
        return out

    runner.build_batch = build_checked
    batch.sampling_tensors = tensors_checked
    return seen


# ---- the property test ---------------------------------------------------------------------------------
PREFIXES = [[(11 * i + 5 * j) % 400 + 3 for j in range(9)] for i in range(3)]
SHAPES = [
    SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=4, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=1.0, min_p=0.05, typical_p=0.95, max_tokens=4),
    SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=4, ignore_eos=True),
    SamplingParams(n=2, best_of=3, temperature=0.7, max_tokens=3, ignore_eos=True),
    SamplingParams(n=2, use_beam_search=True, beam_width=2, max_tokens=4, ignore_eos=True),
    SamplingParams(temperature=0.0, prompt_logprobs=2, logprobs=1, max_tokens=3, ignore_eos=True),
    SamplingParams(temperature=0.9, repetition_penalty=1.2, frequency_penalty=0.3, max_tokens=5),
]
EVENTS = st.one_of(
    st.tuples(st.just("add"), st.integers(0, len(SHAPES) - 1), st.integers(0, 3), st.integers(1, 20)),
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("pause"), st.integers(0, 50), st.booleans()),
)


def drive(engine, events, rng: random.Random) -> None:
    added = 0
    for event in events:
        live = sorted(engine.groups)
        if event[0] == "add":
            _, shape, prefix, tail = event
            head = PREFIXES[prefix - 1] if prefix else []
            engine.add_request(
                f"q{added}", head + [rng.randrange(3, 400) for _ in range(tail)], SHAPES[shape]
            )
            added += 1
        elif event[0] == "step":
            engine.step()
        elif event[0] == "abort" and live:
            engine.abort_request(live[event[1] % len(live)])
        elif event[0] == "pause" and live:
            engine.set_backpressure(live[event[1] % len(live)], event[2])
        engine.check_invariants()  # includes the block-table tensor and the per-slot rows
    for rid in list(engine.groups):
        engine.set_backpressure(rid, False)
    for _ in range(400):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        engine.check_invariants()
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_in_use == 0
    assert not engine.kv.block_tensor.slot_of


def small_engine(preemption: str, max_num_seqs: int = 4, asynchronous: bool = False):
    extra = {"swap_space": 0.01} if preemption == "swap" else {}
    return LLM(
        "tiny-random",
        num_kv_blocks=16,  # 64 tokens for up to 4 sequences of up to 35: preemption
        block_size=4,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8,  # chunked prefill: prompts of up to 29 tokens take several steps
        preemption_mode=preemption,
        enable_prefix_caching=True,
        async_scheduling=asynchronous,
        **extra,
        **ENGINE_DEVICE,
    ).engine


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@settings(max_examples=25, deadline=None, derandomize=True)
@given(events=st.lists(EVENTS, min_size=5, max_size=40))
def test_persistent_batch_equals_a_rebuild_after_every_step(preemption, asynchronous, events):
    """Also under asynchronous scheduling, where a step reads tokens still in flight."""
    engine = small_engine(preemption, asynchronous=asynchronous)
    checked(engine)
    drive(engine, events, random.Random(len(events)))


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_a_busy_run_goes_through_every_kind_of_change(preemption, asynchronous):
    """Negative control for the property test's coverage: a fixed busy schedule preempts, hits the prefix
    cache, chunks prompts, forks samples and beams, and reuses slots — all checked as above."""
    engine = small_engine(preemption, asynchronous=asynchronous)
    seen = checked(engine)
    events = [("add", i % len(SHAPES), i % 4, 5 + 3 * i) for i in range(10)] + [("step",)] * 6
    events += [("abort", 3), ("pause", 1, True), ("step",), ("step",), ("pause", 1, False)]
    # two more with one prefix, a few steps apart: the second hits what the first cached, whatever the
    # schedule before them was (it differs under asynchronous scheduling)
    events += [("add", 0, 1, 2), ("step",), ("step",), ("step",), ("step",), ("add", 0, 1, 3)]
    drive(engine, events, random.Random(0))
    assert engine.stats.preemptions > 0 and engine.stats.prefix_cache_hits > 0
    assert seen["prefill_chunks"] > 0 and seen["sampling_rows"] > 0
    assert (engine.output_processor.num_in_flight_steps > 0) == asynchronous  # steps read tokens in flight
    assert sum(1 for r in engine.terminal_records if r.request_id.startswith("q")) == 12


def test_steady_decode_batch_reads_block_tables_without_a_copy():
    """Slots 0..B-1 in batch order (every sequence admitted in order): the block tables are a view of the
    persistent tensor; another order gathers rows."""
    engine = LLM(
        "tiny-random", num_kv_blocks=64, block_size=4, enable_prefix_caching=False, **ENGINE_DEVICE
    ).engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8, 9], params)
    engine.step()
    scheduled = [(engine.sequences[f"r{i}"], 1) for i in range(3)]
    view = engine.runner.build_batch(scheduled).meta.block_tables
    assert view.data_ptr() == engine.kv.block_tensor.device_table.data_ptr()
    gathered = engine.runner.build_batch(scheduled[::-1]).meta.block_tables
    assert gathered.data_ptr() != view.data_ptr()
    assert gathered.tolist() == view.tolist()[::-1]


def test_a_slot_keeps_no_ended_sequence_alive():
    """A slot's rows are matched to their sequence by identity, not kept alive by it: once a request has
    ended (finished, or aborted mid-prefill as a client that disconnects), nothing in the engine holds its
    sequence, prompt ids or detokenizer. Before, each slot kept the last sequence written to it until
    another took the slot: up to ``max_num_seqs`` ended requests with their whole prompts."""
    import gc

    from kvpilot.engine.sequence import Sequence

    engine = small_engine("recompute", max_num_seqs=4)
    prompt = list(range(5, 25))  # 20 tokens: 3 prefill steps of 8
    engine.add_request("done", prompt, SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False))
    engine.add_request("gone", prompt[::-1], SamplingParams(max_tokens=50, ignore_eos=True))
    gone = engine.groups["gone"].primary
    while gone.num_computed_tokens == 0:  # chunked prefill: "gone" starts once "done" is almost done
        engine.step()
    assert 0 < gone.num_computed_tokens < len(prompt)
    del gone
    engine.abort_request("gone")  # mid-prefill
    while engine.has_unfinished_requests() or engine.has_pending_outputs():
        engine.step()
    gc.collect()
    assert [o.seq_id for o in gc.get_objects() if type(o) is Sequence] == []
