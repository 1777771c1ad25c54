"""Every request shape in one batch, on the test device (``KVPILOT_TEST_DEVICE=cuda`` runs it on a GPU).

Parallel samples and best_of fork rows off a prompt while other rows sample normally (the logits row
gather that crashed on CUDA), beams report whole distributions, and penalties, constraints, logprobs,
prompt logprobs, seeds, truncation filters, a prefix-cache hit and swap preemption all run in the same
steps. Each request must end once, with the outputs its parameters ask for, and leave no block in use.
"""

from __future__ import annotations

import pytest
from engine_device import ENGINE_DEVICE

from kvpilot.engine import LLM, SamplingParams

PROMPT = [(7 * i + 3) % 400 + 5 for i in range(22)]
SHAPES = {
    "n3": SamplingParams(n=3, temperature=1.0, max_tokens=6, ignore_eos=True),
    "best_of": SamplingParams(n=2, best_of=4, temperature=0.8, max_tokens=5, ignore_eos=True),
    "beam": SamplingParams(
        n=2, use_beam_search=True, beam_width=3, temperature=0.0, max_tokens=4, ignore_eos=True
    ),
    "greedy_logprobs": SamplingParams(
        temperature=0.0, logprobs=5, prompt_logprobs=3, max_tokens=6, ignore_eos=True
    ),
    "penalties": SamplingParams(
        temperature=0.9,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.4,
        max_tokens=6,
        ignore_eos=True,
        seed=5,
    ),
    "constraints": SamplingParams(
        temperature=1.0,
        allowed_token_ids=list(range(100, 140)),
        logit_bias={120: 5.0},
        no_repeat_ngram_size=2,
        min_tokens=3,
        max_tokens=6,
    ),
    "filters": SamplingParams(
        temperature=0.7,
        top_k=20,
        top_p=0.9,
        min_p=0.01,
        typical_p=0.95,
        max_tokens=6,
        ignore_eos=True,
        seed=9,
        logprobs=2,
    ),
    "seeded_n2": SamplingParams(n=2, temperature=1.0, seed=123, max_tokens=6, ignore_eos=True),
}


def run_all(llm: LLM, requests: dict[str, tuple[list[int], SamplingParams]]):
    engine = llm.engine
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done, "a request finished twice"
                done[out.request_id] = out
        engine.check_invariants()
    assert engine.pool.num_in_use == 0
    return done


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_every_request_shape_in_one_batch(preemption: str) -> None:
    extra = {"swap_space": 0.01} if preemption == "swap" else {}
    # 32 blocks of 4 tokens cannot hold every sample of every request at once: preemption happens
    llm = LLM(
        "tiny-random",
        num_kv_blocks=32,
        block_size=4,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        preemption_mode=preemption,
        **extra,
        **ENGINE_DEVICE,
    )
    engine = llm.engine
    requests = {name: ([*PROMPT[: 10 + i], i + 3], params) for i, (name, params) in enumerate(SHAPES.items())}
    requests["prefix_hit"] = (
        [*PROMPT[:16], 77, 78],
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
    )
    llm.generate([[*PROMPT[:16], 1]], SamplingParams(temperature=0.0, max_tokens=1))  # caches 4 full blocks
    records_before = len(engine.terminal_records)
    done = run_all(llm, requests)

    assert sorted(done) == sorted(requests)
    assert engine.scheduler.num_preemptions > 0
    records = engine.terminal_records[records_before:]
    assert sorted(r.request_id for r in records) == sorted(requests)  # one terminal record each
    assert {r.status for r in records} == {"finished"}
    counts = {rid: len(out.outputs) for rid, out in done.items()}
    assert counts == {
        "n3": 3,
        "best_of": 2,
        "beam": 2,
        "greedy_logprobs": 1,
        "penalties": 1,
        "constraints": 1,
        "filters": 1,
        "seeded_n2": 2,
        "prefix_hit": 1,
    }
    for rid in ("n3", "best_of", "penalties", "filters", "seeded_n2", "greedy_logprobs"):
        assert all(len(c.token_ids) == requests[rid][1].max_tokens for c in done[rid].outputs), rid
    assert all(len(c.token_ids) == 4 for c in done["beam"].outputs)
    assert all(100 <= t < 140 for t in done["constraints"].outputs[0].token_ids)
    greedy = done["greedy_logprobs"]
    assert all(len(step) >= 5 for step in greedy.outputs[0].logprobs)
    assert greedy.prompt_logprobs[0] is None and all(len(p) >= 3 for p in greedy.prompt_logprobs[1:])
    assert len(greedy.prompt_logprobs) == len(requests["greedy_logprobs"][0])
    assert all(len(step) >= 2 for step in done["filters"].outputs[0].logprobs)
    assert done["prefix_hit"].num_cached_tokens == 16


def test_seeded_requests_do_not_depend_on_the_batch() -> None:
    """A seeded request's tokens are the same alone and inside the mixed batch (its own generators)."""
    alone = LLM("tiny-random", num_kv_blocks=256, block_size=4, **ENGINE_DEVICE)
    prompt = [*PROMPT[:12], 4]
    solo = alone.generate([prompt], SHAPES["seeded_n2"])[0]
    mixed = LLM("tiny-random", num_kv_blocks=256, block_size=4, **ENGINE_DEVICE)
    requests = {name: ([*PROMPT[: 10 + i], i + 3], params) for i, (name, params) in enumerate(SHAPES.items())}
    requests["seeded_n2"] = (prompt, SHAPES["seeded_n2"])
    batch = run_all(mixed, requests)["seeded_n2"]
    assert [c.token_ids for c in batch.outputs] == [c.token_ids for c in solo.outputs]
    assert batch.outputs[0].token_ids != batch.outputs[1].token_ids  # the two samples draw differently
