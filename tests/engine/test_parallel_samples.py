"""n > 1 / best_of share the prompt's KV blocks by reference count with copy-on-write of the shared
partial block (M_KV ≈ M_prompt + n·M_generated), and beam search on the same blocks
(docs/architecture.md#parallel-samples-and-beams)."""

from __future__ import annotations

import pytest
import torch
from engine_device import ENGINE_DEVICE
from transformers import LlamaForCausalLM as HFLlama

from kvpilot.engine import LLM, SamplingParams

PROMPT = list(range(40, 50))  # 10 tokens: with block size 4, two full blocks and a partial one


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-random", num_kv_blocks=64, block_size=4, **ENGINE_DEVICE)


def test_samples_share_prompt_blocks_and_copy_the_partial_block_on_write(llm):
    engine = llm.engine
    engine.add_request(
        "par", PROMPT, SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    )
    engine.step()  # prefill + first token of each sample (samples 1, 2 forked from the prompt)
    seqs = [s.seq for s in engine.groups["par"].samples]
    tables = [engine.kv.block_table(s) for s in seqs]
    assert len(seqs) == 3 and tables[0] == tables[1] == tables[2] and len(tables[0]) == 3
    assert [engine.pool.ref_cnt[b] for b in tables[0]] == [3, 3, 3]
    assert engine.pool.num_in_use == 3
    engine.check_invariants()
    engine.step()  # each sample writes position 10 into the shared partial block: two copy it
    tables = [engine.kv.block_table(s) for s in seqs]
    assert [t[:2] for t in tables] == [tables[0][:2]] * 3  # the full prompt blocks stay shared
    assert len({t[2] for t in tables}) == 3  # three private last blocks
    assert engine.pool.num_in_use == 2 + 3  # M_prompt (2 full blocks) + n × 1
    for _ in range(3):
        engine.step()
    engine.check_invariants()
    # 15 tokens each = 4 blocks; shared: 2 + 3 × 2 = 8 (vs 12 without sharing)
    assert [s.num_tokens for s in seqs] == [15, 15, 15]
    assert engine.pool.num_in_use == 8
    out = engine.step()[0]
    assert out.finished and [len(c.token_ids) for c in out.outputs] == [6, 6, 6]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # independent samples
    assert engine.pool.num_in_use == 0
    assert [r.request_id for r in engine.terminal_records] == ["par"]


def test_seeded_parallel_samples_are_reproducible(llm):
    p = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=5, ignore_eos=True)
    a = [c.token_ids for c in llm.generate([PROMPT], p)[0].outputs]
    b = [
        c.token_ids
        for c in llm.generate([PROMPT, list(range(60, 80))], [p, SamplingParams(max_tokens=3)])[0].outputs
    ]
    assert a == b
    single = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=5, max_tokens=5, ignore_eos=True))[0]
    assert single.outputs[0].token_ids == a[0]  # sample 0 draws from the request's own seed


def test_best_of_returns_the_n_most_likely_samples(llm):
    out = llm.generate(
        [PROMPT], SamplingParams(n=2, best_of=5, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)
    )[0]
    assert len(out.outputs) == 2
    scores = [c.cumulative_logprob for c in out.outputs]
    assert scores == sorted(scores, reverse=True)
    record = llm.engine.terminal_records[-1]
    assert record.num_generated == 5 * 4 and record.num_committed == 2 * 4


def test_best_of_never_prefers_a_sample_that_ended_without_a_possible_token(llm):
    """A sample left without a token (here the three allowed ids' bigrams run out) scored only the tokens
    it had, so best_of returned it first over every longer sample, and the request ended "error"."""
    kw = dict(temperature=1.0, seed=18, max_tokens=7, no_repeat_ngram_size=2, allowed_token_ids=[8, 272, 329])
    every = llm.generate([[235, 17]], SamplingParams(n=8, logprobs=0, **kw))[0].outputs
    assert [c.finish_reason for c in every].count("error") == 1  # the control: one sample dies
    ranked = sorted((c for c in every if c.finish_reason != "error"), key=lambda c: -c.cumulative_logprob)
    kept = llm.generate([[235, 17]], SamplingParams(n=2, best_of=8, **kw))[0].outputs
    assert [(c.token_ids, c.finish_reason) for c in kept] == [(c.token_ids, "length") for c in ranked[:2]]
    assert llm.engine.terminal_records[-1].finish_reason == "length"


def reference_beam_search(
    hf, prompt: list[int], width: int, steps: int, length_penalty: float
) -> list[list[int]]:
    """Same rules as the engine (2W candidates per beam, ranking by cumulative logprob, ties by beam then
    token id), computed with full HF forwards."""
    beams = [([], 0.0)]
    for _ in range(steps):
        cands = []
        for order, (toks, cum) in enumerate(beams):
            with torch.no_grad():
                lp = hf(torch.tensor([prompt + toks])).logits[0, -1].log_softmax(-1)
            values, ids = lp.topk(2 * width)
            cands += [(cum + v, order, t, toks) for v, t in zip(values.tolist(), ids.tolist(), strict=True)]
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        beams = [([*toks, t], score) for score, _, t, toks in cands[:width]]
    ranked = sorted(beams, key=lambda b: -b[1] / len(b[0]) ** length_penalty)
    return [toks for toks, _ in ranked]


def test_beam_search_matches_a_reference_and_frees_every_block(llm, tiny_model_dir):
    hf = HFLlama.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    params = SamplingParams(use_beam_search=True, beam_width=3, n=3, max_tokens=5, ignore_eos=True)
    out = llm.generate([PROMPT], params)[0]
    expected = reference_beam_search(hf, PROMPT, 3, 5, 1.0)
    assert [c.token_ids for c in out.outputs] == expected
    llm.engine.check_invariants()
    assert llm.engine.pool.num_in_use == 0


@pytest.mark.parametrize(("width", "generated"), [(1, 8), (2, 1 + 2 * 7)])
def test_beam_search_counts_the_distributions_it_scored_as_generated(llm, width, generated):
    """Forks copy their parent's tokens and a hypothesis' last token is never appended to a sequence, so
    summing the beams' lengths gave 7 generated for 8 committed at width 1 (and overcounted wider)."""
    rid = f"beams-{width}"
    params = SamplingParams(use_beam_search=True, beam_width=width, max_tokens=8, ignore_eos=True)
    llm.engine.add_request(rid, PROMPT, params)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    (record,) = [r for r in llm.engine.terminal_records if r.request_id == rid]
    assert (record.num_generated, record.num_committed) == (generated, 8)


@pytest.mark.parametrize("length_penalty", [1000.0, -1000.0, 1e308])
def test_beam_search_ranks_with_any_length_penalty(llm, length_penalty):
    """len ** length_penalty leaves float range here: scoring raised OverflowError / ZeroDivisionError on
    the engine thread, which stopped the server."""
    params = SamplingParams(
        use_beam_search=True, beam_width=2, n=2, max_tokens=4, length_penalty=length_penalty
    )
    out = llm.generate([PROMPT], params)[0]
    assert len(out.outputs) == 2 and all(c.token_ids for c in out.outputs)
    assert llm.engine.pool.num_in_use == 0


def test_normalised_score_keeps_the_order_of_the_plain_quotient():
    """In range it is the plain quotient; past it (a power that overflows or underflows) it still ranks
    as the quotient would, saturating at 0 and about -8e307 where floats end, and never raises."""
    from kvpilot.engine.beam_search import normalised_score

    assert normalised_score(-6.0, 3, 1.0) == -2.0
    assert normalised_score(0.0, 5, 1e308) == 0.0
    for penalty in (1000.0, 1e308):  # longer hypotheses are divided by more: they rank at least as high
        assert normalised_score(-1.0, 3, penalty) >= normalised_score(-1.0, 2, penalty)
    for penalty in (-1000.0, -1e308):  # shorter ones rank at least as high, never -inf
        longer, shorter = normalised_score(-1.0, 3, penalty), normalised_score(-1.0, 2, penalty)
        assert -1e308 <= longer <= shorter < 0.0


def test_beam_search_ends_hypotheses_at_stop_token_ids(llm):
    """stop_token_ids were ignored by beam search (only EOS ended a hypothesis)."""
    free = llm.generate(
        [PROMPT], SamplingParams(use_beam_search=True, beam_width=2, max_tokens=6, ignore_eos=True)
    )
    tokens = free[0].outputs[0].token_ids
    stop = tokens[2]
    params = SamplingParams(
        use_beam_search=True, beam_width=2, max_tokens=6, ignore_eos=True, stop_token_ids=[stop]
    )
    for c in llm.generate([PROMPT], params)[0].outputs:
        assert stop not in c.token_ids[:-1]  # nothing continues past a stop token
        if c.token_ids[-1] == stop:
            assert (c.finish_reason, c.stop_reason) == ("stop", stop)


def test_a_stop_token_candidate_becomes_a_finished_hypothesis():
    from kvpilot.engine.beam_search import BeamSearch

    logprobs = torch.tensor([0.0, 1.0, 2.0, 5.0, 0.0]).log_softmax(-1)
    for stops, continued in ((frozenset({3}), [2, 1]), (frozenset(), [3, 2])):
        search = BeamSearch(2, 1.0, 5, frozenset({0}), ignore_eos=True, stop_token_ids=stops)
        search.start("a")
        search.report("a", logprobs)
        assert [c.token for c in search.select().continue_with] == continued
        assert [(h.tokens, h.finish_reason, h.stop_reason) for h in search.finished] == (
            [([3], "stop", 3)] if stops else []
        )


@pytest.mark.parametrize(
    ("params", "generated"),
    [
        (SamplingParams(n=1, best_of=4, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True), 20),
        (SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True), 15),
    ],
)
def test_terminal_record_counts_only_tokens_the_client_received(llm, params, generated):
    """best_of's discarded samples were generated but never sent: they are not in ``num_emitted``."""
    engine = llm.engine
    rid = f"counted-{generated}"
    engine.add_request(rid, PROMPT, params)
    while engine.has_unfinished_requests():
        engine.step()
    (record,) = [r for r in engine.terminal_records if r.request_id == rid]
    assert (record.num_generated, record.num_emitted, record.num_committed) == (
        generated,
        5 * params.n,
        5 * params.n,
    )


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("num_blocks", [24, 28])
def test_beam_search_under_preemption_gives_the_unpreempted_beams(preemption, num_blocks):
    """A beam that has reported its distribution and waits for its siblings is the likeliest preemption
    victim (it is not scheduled): the selection then prunes, extends or forks it while it is preempted or
    swapped out. Before, that crashed (a second selection of one step, an illegal swapped -> finished
    transition). The beams must come out as with a cache large enough for no preemption."""
    beam = SamplingParams(n=2, use_beam_search=True, beam_width=3, max_tokens=8, ignore_eos=True)
    prompts = [list(range(40, 50 + 3 * i)) for i in range(4)]

    def run(blocks: int, mode: str):
        extra = {"swap_space": 0.01} if mode == "swap" else {}
        small = LLM(
            "tiny-random",
            num_kv_blocks=blocks,
            block_size=4,
            max_num_seqs=16,
            preemption_mode=mode,
            **extra,
            **ENGINE_DEVICE,
        )
        engine = small.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(f"b{i}", prompt, beam)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = [c.token_ids for c in out.outputs]
            engine.check_invariants()
        assert engine.pool.num_in_use == 0
        return done, engine.stats.preemptions

    expected, none = run(400, "recompute")
    done, preemptions = run(num_blocks, preemption)
    assert none == 0 and preemptions > 0
    assert done == expected
