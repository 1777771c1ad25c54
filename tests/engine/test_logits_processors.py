"""Constraints and penalties with exact values, and the logprobs modes
(docs/architecture.md#sampling-pipeline)."""

from __future__ import annotations

import math

import pytest
import torch

from kvpilot.engine.sampling.logits_processors import (
    RowState,
    apply_constraints,
    apply_penalties,
    banned_by_bad_words,
    banned_by_ngrams,
    update_ngram_index,
)
from kvpilot.engine.sampling.params import SamplingParams
from kvpilot.engine.sampling.sampler import Sampler

NEG = float("-inf")


def state(prompt=(), output=(), eos=frozenset({0}), bad=(), **kw) -> RowState:
    st = RowState(SamplingParams(**kw), list(prompt), list(output), eos, [list(b) for b in bad], {})
    for i in range(1, len(output) + 1):
        update_ngram_index(st.ngram_index, list(output[:i]), st.params.no_repeat_ngram_size)
    return st


def test_repetition_penalty_is_sign_aware_over_prompt_and_output():
    z = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    out = apply_penalties(z.clone(), [state(prompt=[0, 1], output=[4], repetition_penalty=2.0)])
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0, 0.5]]  # z/r if z>0, z·r if z<0, unseen untouched


def test_frequency_and_presence_count_generated_tokens_only():
    z = torch.zeros(1, 4)
    st = state(prompt=[3, 3, 3], output=[1, 1, 2], frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(z.clone(), [st])
    assert out.tolist() == [[0.0, -1.25, -0.75, 0.0]]  # token 3 appears only in the prompt


def test_logit_bias_is_clamped_to_100_and_allowed_ids_mask_first():
    z = torch.zeros(1, 5)
    out = apply_constraints(z.clone(), [state(logit_bias={1: 250.0, 2: -3.0})])
    assert out.tolist() == [[0.0, 100.0, -3.0, 0.0, 0.0]]
    out = apply_constraints(z.clone(), [state(allowed_token_ids=[1, 3], logit_bias={0: 5.0, 3: 1.0})])
    assert out.tolist() == [[NEG, 0.0, NEG, 1.0, NEG]]  # bias cannot revive a disallowed token


def test_bad_words_mask_only_the_token_that_would_complete_a_banned_sequence():
    banned = [[5, 6, 7], [9]]
    assert banned_by_bad_words([1, 5, 6], banned) == {7, 9}
    assert banned_by_bad_words([1, 5], banned) == {9}  # 7 is fine: the sequence is not at its end
    assert banned_by_bad_words([], banned) == {9}
    out = apply_constraints(torch.zeros(1, 10), [state(output=[5, 6], bad=banned)])
    assert support_of(out) == set(range(10)) - {7, 9}


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    z = torch.zeros(1, 6)
    before = apply_constraints(
        z.clone(), [state(output=[4], eos=frozenset({0}), min_tokens=2, stop_token_ids=[3])]
    )
    assert support_of(before) == {1, 2, 4, 5}
    after = apply_constraints(
        z.clone(), [state(output=[4, 4], eos=frozenset({0}), min_tokens=2, stop_token_ids=[3])]
    )
    assert support_of(after) == set(range(6))


def test_no_repeat_ngram_bans_completions_of_seen_ngrams():
    st = state(output=[1, 2, 3, 1, 2], no_repeat_ngram_size=3)
    assert banned_by_ngrams(st.ngram_index, st.output_token_ids, 3) == {3}  # "1 2 3" already generated
    out = apply_constraints(torch.zeros(1, 5), [st])
    assert support_of(out) == {0, 1, 2, 4}
    st2 = state(output=[4, 4], no_repeat_ngram_size=1)  # unigram: every generated token is banned
    assert support_of(apply_constraints(torch.zeros(1, 6), [st2])) == {0, 1, 2, 3, 5}


def support_of(t: torch.Tensor) -> set[int]:
    return set(torch.isfinite(t[0]).nonzero(as_tuple=True)[0].tolist())


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_logprobs_modes_report_raw_or_the_sampled_distribution(mode):
    z = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0.5, top_k=2, logprobs=4, seed=1)
    out = Sampler(torch.Generator().manual_seed(0), mode).sample(z, [RowState(params, [], [])])
    tok = out.token_ids[0]
    assert tok in (0, 1)
    top = out.top_logprobs[0]
    if mode == "raw_logprobs":
        expected = torch.log_softmax(z[0], -1)
        assert [round(top[t].logprob, 5) for t in range(4)] == [round(v, 5) for v in expected.tolist()]
    else:  # after T = 0.5 and top-k 2: two tokens with p ∝ e^6, e^4; the rest impossible
        p0 = 1 / (1 + math.exp(-2.0))
        assert top[0].logprob == pytest.approx(math.log(p0), abs=1e-5)
        assert top[1].logprob == pytest.approx(math.log(1 - p0), abs=1e-5)
        assert top[2].logprob == NEG and top[3].logprob == NEG
    assert top[0].rank == 1 and top[1].rank == 2
    assert out.sampled_logprobs[0] == top[tok].logprob


def test_all_greedy_fast_path_matches_the_full_pipeline():
    z = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    fast = Sampler(torch.Generator()).sample(z, [RowState(SamplingParams(temperature=0), [], [])] * 6)
    full = Sampler(torch.Generator()).sample(
        z, [RowState(SamplingParams(temperature=0, logprobs=0), [], [])] * 6
    )
    assert fast.token_ids == full.token_ids == z.argmax(-1).tolist()


@pytest.mark.parametrize("native", [False, True], ids=["tensor", "native"])
@pytest.mark.parametrize(
    "kw", [{"temperature": 0.0}, {"temperature": 1.0, "top_p": 0.9}, {"temperature": 0.7, "logprobs": 1}]
)
def test_a_row_whose_constraints_leave_no_token_gets_no_token(kw, native, kvpilot_cache_dir):
    """allowed_token_ids = [EOS] while min_tokens masks EOS: no token is possible. That row gets NO_TOKEN
    (never an id its constraints forbid, nor an index error in the draw); the others are untouched."""
    from kvpilot.engine.native import ops
    from kvpilot.engine.sampling.sampler_output import NO_TOKEN

    kernels = ops.load_native_ops(kvpilot_cache_dir, ()).sampling if native else None
    z = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    dead = RowState(SamplingParams(allowed_token_ids=[0], min_tokens=2, **kw), [5], [], frozenset({0}))
    plain = RowState(SamplingParams(**kw), [5], [])
    sampler = Sampler(torch.Generator().manual_seed(3), native=kernels)
    out = sampler.sample(z, [plain, dead, plain])
    assert out.token_ids[1] == NO_TOKEN
    assert all(0 <= t < 40 for t in (out.token_ids[0], out.token_ids[2]))
    if "logprobs" in kw:
        assert out.top_logprobs[1] is None and out.sampled_logprobs[1] is None
    on_device = sampler.sample_tokens(z, [plain, dead, plain])
    assert on_device[1].item() == NO_TOKEN


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 0.0, "allowed_token_ids": [2], "min_tokens": 2},
        {"temperature": 1.0, "top_p": 0.9, "allowed_token_ids": [2], "min_tokens": 2},
        # three allowed ids, each banned once it has appeared: the fourth step has none left
        {"temperature": 1.0, "seed": 0, "no_repeat_ngram_size": 1, "allowed_token_ids": [8, 272, 329]},
    ],
    ids=["greedy", "top-p", "n-grams"],
)
def test_a_request_left_without_tokens_ends_with_an_error_and_spares_the_batch(kw, asynchronous):
    """It crashed the step (an out-of-vocabulary id from the draw), which fails every open request in the
    server; greedy rows emitted token 0, which allowed_token_ids forbids."""
    from engine_device import ENGINE_DEVICE

    from kvpilot.engine import LLM

    def run(with_dead: bool) -> dict[str, tuple]:
        engine = LLM("tiny-random", num_kv_blocks=64, async_scheduling=asynchronous, **ENGINE_DEVICE).engine
        engine.add_request("bystander", [5, 6, 7], SamplingParams(temperature=0, max_tokens=10))
        if with_dead:
            engine.add_request("dead", [235], SamplingParams(max_tokens=6, **kw))
        done = {}
        for _ in range(50):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
            if not engine.has_unfinished_requests():
                break
        engine.check_invariants()
        assert not engine.has_unfinished_requests() and engine.pool.num_in_use == 0
        return done

    done = run(True)
    tokens, reason = done["dead"]
    assert reason == "error" and set(tokens) <= set(kw["allowed_token_ids"])
    assert len(tokens) == (3 if "no_repeat_ngram_size" in kw else 0)
    assert done["bystander"] == run(False)["bystander"]


# "xx" is tokenized [123, 123]: once the one allowed token has been generated, bad_words bans it
_DEAD_END = {"allowed_token_ids": [123], "bad_words": ["xx"], "max_tokens": 8}
_DEAD_END_PROMPT = [123, 40, 50] * 4 + [123]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculation_stops_where_the_constraints_leave_no_token(temperature):
    """Verification drew from the zeroed row: greedy emitted token 0, sampling random ids, around the one
    allowed token ([123, 0, 123, 0, ...])."""
    from engine_device import ENGINE_DEVICE

    from kvpilot.engine import LLM

    spec = {"method": "ngram", "num_speculative_tokens": 3}
    params = SamplingParams(temperature=temperature, seed=1, **_DEAD_END)
    for speculative in (None, spec):
        llm = LLM("tiny-random", num_kv_blocks=64, speculative_config=speculative, **ENGINE_DEVICE)
        (out,) = llm.generate([_DEAD_END_PROMPT], params)[0].outputs
        assert (out.token_ids, out.finish_reason) == ([123], "error")


@pytest.mark.parametrize("width", [1, 2])
def test_a_beam_search_left_without_tokens_ends_with_an_error_and_keeps_its_hypothesis(width):
    """Every candidate was -inf, so the search ended with no hypothesis: no choices and finish "stop"."""
    from engine_device import ENGINE_DEVICE

    from kvpilot.engine import LLM

    llm = LLM("tiny-random", num_kv_blocks=64, **ENGINE_DEVICE)
    params = SamplingParams(use_beam_search=True, beam_width=width, **_DEAD_END)
    (out,) = llm.generate([_DEAD_END_PROMPT], params)[0].outputs
    assert (out.token_ids, out.finish_reason) == ([123], "error")
    (record,) = llm.engine.terminal_records
    assert record.finish_reason == "error" and llm.engine.pool.num_in_use == 0
