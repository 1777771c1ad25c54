"""Speculative decoding through the engine (docs/architecture.md#speculative-decoding), on the tiny model:
greedy outputs identical with and without speculation (penalties, logprobs, stops, max_tokens, grammars,
parallel samples, preemption), the sampled distribution unchanged (a two-sample chi-square test with a wrong
rule as its negative control), and no leaked blocks under random cancels and preemption. Every test also
checks that drafts were proposed and accepted, so speculation really ran."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest
from engine_runs import run_checked as run

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.config import ConfigError
from kvpilot.engine.engine_args import EngineArgs
from kvpilot.engine.spec_decode import verify
from kvpilot.engine.structured.params import StructuredOutputsParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 64}
DRAFT = {"method": "draft_model", "num_speculative_tokens": 3, "disable_by_batch_size": 64}


def repetitive_prompts(seed: int, count: int, period: int = 8, repeats: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(period)] * repeats for _ in range(count)]


@pytest.fixture(scope="module")
def plain(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), num_kv_blocks=512)


@pytest.fixture(scope="module")
def spec(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), num_kv_blocks=512, speculative_config=SPEC)


def accepted_since(llm: LLM, before: int) -> int:
    return llm.engine.stats.spec_accepted_tokens - before


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=37, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=0.4, min_tokens=25),
    ],
    ids=["plain", "repetition-penalty", "frequency-penalty"],
)
def test_greedy_tokens_are_identical_with_speculation(plain: LLM, spec: LLM, params: SamplingParams):
    prompts = repetitive_prompts(1, 6)
    before = spec.engine.stats.spec_accepted_tokens
    want = [o.outputs[0].token_ids for o in run(plain, prompts, params)]
    got = [o.outputs[0].token_ids for o in run(spec, prompts, params)]
    assert got == want
    assert all(len(t) == params.max_tokens for t in got)  # max_tokens cuts mid-speculation exactly
    assert accepted_since(spec, before) > 0


def test_logprobs_of_emitted_tokens_match_the_plain_engine(plain: LLM, spec: LLM):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = repetitive_prompts(2, 3)
    before = spec.engine.stats.spec_accepted_tokens
    want, got = run(plain, prompts, params), run(spec, prompts, params)
    assert accepted_since(spec, before) > 0
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert lw.keys() == lg.keys()
            for tok in lw:
                assert lg[tok].logprob == pytest.approx(lw[tok].logprob, abs=1e-5)
                assert lg[tok].rank == lw[tok].rank


def test_a_stop_token_inside_the_accepted_drafts_ends_the_request_there(plain: LLM, spec: LLM):
    prompts = repetitive_prompts(3, 4)
    free = run(plain, prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    stops = [o.outputs[0].token_ids[12] for o in free]  # a token each output reaches mid-way
    params = [SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[t]) for t in stops]
    want, got = run(plain, prompts, params), run(spec, prompts, params)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason == "stop"


def test_parallel_samples_and_preemption_under_speculation(tiny_model_dir, plain: LLM):
    # 40 blocks of 16 tokens for 6 requests of ~90 tokens each and their samples: preemption is certain
    small = LLM(str(tiny_model_dir), num_kv_blocks=40, speculative_config=SPEC)
    prompts = repetitive_prompts(4, 6, repeats=6)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=2)
    want = [[c.token_ids for c in o.outputs] for o in run(plain, prompts, params)]
    got = [[c.token_ids for c in o.outputs] for o in run(small, prompts, params)]
    assert got == want
    assert small.engine.stats.preemptions > 0
    assert small.engine.stats.spec_accepted_tokens > 0


def test_random_cancels_during_speculation_leak_nothing(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=48, speculative_config=SPEC)
    engine, rng = llm.engine, random.Random(5)
    prompts = repetitive_prompts(6, 16)
    for i, p in enumerate(prompts):
        temperature = 0.0 if i % 2 else 0.8
        engine.add_request(
            f"c{i}", p, SamplingParams(temperature=temperature, max_tokens=48, ignore_eos=True)
        )
    live = {f"c{i}" for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        if rng.random() < 0.15:
            victim = rng.choice(sorted(live))
            engine.abort_request(victim)
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
        live &= set(engine.groups)
        engine.check_invariants()
    assert engine.pool.num_in_use == 0
    records = engine.terminal_records
    assert sorted(r.request_id for r in records) == sorted(f"c{i}" for i in range(len(prompts)))  # one each
    # per-request accounting adds up to the engine's, cancelled requests included
    assert sum(r.num_accepted_tokens for r in records) == engine.stats.spec_accepted_tokens > 0
    assert sum(r.num_draft_tokens for r in records) == engine.stats.spec_draft_tokens
    assert all(r.num_accepted_tokens <= min(r.num_generated, r.num_draft_tokens) for r in records)


@pytest.mark.parametrize(
    ("text", "regex"), [("abab abab abab abab", "(abab ){3,6}"), ("1,2,3,1,2,3,1,2,3,", "(1,2,3,){2,6}")]
)
def test_structured_outputs_with_speculation_match_the_plain_engine(plain: LLM, spec: LLM, text, regex):
    # the prompt repeats what the grammar allows, so prompt lookup proposes tokens the grammar accepts
    prompt = spec.engine.tokenizer.encode(text)
    params = SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex)
    )
    before = spec.engine.stats.spec_accepted_tokens
    (want,), (got,) = run(plain, [prompt], params), run(spec, [prompt], params)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.outputs[0].finish_reason == "stop"
    assert re.fullmatch(regex, got.outputs[0].text)
    assert accepted_since(spec, before) > 0


def pair_counts(llm: LLM, prompt: list[int], n: int) -> Counter:
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    return Counter(tuple(o.outputs[0].token_ids[1:]) for o in run(llm, [prompt] * n, params))


def two_sample_chi_square(a: Counter, b: Counter) -> tuple[float, int]:
    """Two samples of equal size: statistic and degrees of freedom, cells seen fewer than 10 times in
    both samples together pooled into one (so no cell is too sparse for the approximation)."""
    pooled_a = pooled_b = 0
    stat, cells = 0.0, 0
    for c in set(a) | set(b):
        if a[c] + b[c] < 10:
            pooled_a, pooled_b = pooled_a + a[c], pooled_b + b[c]
            continue
        stat, cells = stat + (a[c] - b[c]) ** 2 / (a[c] + b[c]), cells + 1
    if pooled_a + pooled_b:
        stat, cells = stat + (pooled_a - pooled_b) ** 2 / (pooled_a + pooled_b), cells + 1
    return stat, cells - 1


def chi_square_critical(dof: int, z: float = 3.090) -> float:
    """The p = 0.001 quantile (z of the normal's) by Wilson-Hilferty, within 1% for dof >= 3."""
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def _accept_every_draft(target_probs, drafts, num_draft, draft_probs, uniforms, final_uniforms):
    """A wrong rule: every draft is accepted, whatever the target thinks of it."""
    import torch

    from kvpilot.engine.spec_decode.rejection import _emit

    last = target_probs[torch.arange(len(drafts)), num_draft].argmax(dim=-1)
    return _emit(drafts, num_draft, last), num_draft + 1


@pytest.fixture(scope="module")
def lookup_prompt(plain: LLM) -> list[int]:
    """A prompt whose continuation is predicted by its own earlier text: a seed, the model's greedy
    continuation of it, then the seed again — prompt lookup then proposes the continuation, which is
    likely under the model (so drafts are accepted often, rejected sometimes)."""
    seed = repetitive_prompts(8, 1, period=6, repeats=1)[0]
    greedy = run(plain, [seed], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    return seed + greedy[0].outputs[0].token_ids + seed


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("wrong", [False, True], ids=["exact-rule", "wrong-rule-negative-control"])
def test_sampled_tokens_keep_the_targets_distribution(
    tiny_model_dir, plain: LLM, lookup_prompt, monkeypatch, wrong, method
):
    # draft_model: the target itself drafts, from softmax(z / T) without the target's top-k, so its q is
    # neither one-hot nor the target's p: drafts outside the top 3 are always rejected, others accepted
    # with min(1, p/q) and rejections drawn from norm(max(0, p - q))
    config = SPEC if method == "ngram" else {**DRAFT, "model": str(tiny_model_dir)}
    spec = LLM(str(tiny_model_dir), num_kv_blocks=512, speculative_config=config, seed=11)
    if wrong:
        monkeypatch.setattr(verify, "accept_sampled", _accept_every_draft)
    a = pair_counts(plain, lookup_prompt, 1200)
    b = pair_counts(spec, lookup_prompt, 1200)
    stat, dof = two_sample_chi_square(a, b)
    assert spec.engine.stats.spec_draft_tokens > 0
    assert dof >= 3, (a, b)
    if wrong:
        assert stat > chi_square_critical(dof), (stat, dof, a, b)
    else:
        assert 0 < spec.engine.stats.spec_accepted_tokens < spec.engine.stats.spec_draft_tokens
        assert stat < chi_square_critical(dof), (stat, dof, a, b)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory) -> str:
    """A tiny model with the target's tokenizer and other weights: its drafts are mostly rejected."""
    from kvpilot.engine.model.tiny import write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("draft"), seed=7))


@pytest.mark.parametrize("which", ["same-weights", "other-weights"])
def test_greedy_tokens_are_identical_with_a_draft_model(tiny_model_dir, plain: LLM, other_draft, which):
    draft = str(tiny_model_dir) if which == "same-weights" else other_draft
    llm = LLM(str(tiny_model_dir), num_kv_blocks=512, speculative_config={**DRAFT, "model": draft})
    params = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
    prompts = repetitive_prompts(10, 5)
    want = [o.outputs[0].token_ids for o in run(plain, prompts, params)]
    assert [o.outputs[0].token_ids for o in run(llm, prompts, params)] == want
    stats = llm.engine.stats
    if which == "same-weights":  # the draft's cache mirrors the target's: it proposes the target's tokens
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0
    else:
        assert stats.spec_accepted_tokens < stats.spec_draft_tokens / 4


@pytest.mark.parametrize(
    ("engine_args", "prompts", "max_tokens"),
    [
        ({}, [[5, 6, 7, 8, 9], [40, 41, 42]], [12, 40]),
        ({"max_model_len": 16}, [list(range(20, 33)), [40, 41]], [None, None]),
    ],
    ids=["near-max-tokens", "near-the-context-limit"],
)
def test_a_draft_model_proposes_for_rows_with_fewer_drafts_than_the_batch(
    tiny_model_dir, other_draft, engine_args, prompts, max_tokens
):
    """Every speculating row took all ``k`` draft forwards, also one whose limit (``max_tokens`` or the
    context) allowed fewer: its positions past the limit had no slot in its block table, so the step raised
    ("a sequence is longer than its block table covers", or an IndexError at the context limit). Each
    forward now runs only the rows still drafting; the outputs are the plain engine's."""
    common = {"block_size": 4, "num_kv_blocks": 64, **engine_args}
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    want = run(LLM(str(tiny_model_dir), **common), prompts, params)
    llm = LLM(
        str(tiny_model_dir),
        **common,
        speculative_config={**DRAFT, "num_speculative_tokens": 4, "model": other_draft},
    )
    got = run(llm, prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].finish_reason for o in got] == ["length", "length"]
    assert llm.engine.stats.spec_draft_tokens > 0


def test_a_draft_model_under_swap_preemption_with_forks_and_prefix_hits(tiny_model_dir):
    """Drafting sequences swapped out and back (the draft's cache is stale there), forked samples and
    prefix-cache hits on a shared prefix: the outputs are those of a plain engine whose cache never
    preempts."""
    rng = random.Random(3)
    prefix = [rng.randrange(3, 500) for _ in range(4)] * 3
    prompts = [prefix + [rng.randrange(3, 500) for _ in range(rng.randint(1, 4))] for _ in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=1 + i % 2) for i in range(4)]
    params.append(SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[0]))
    common = {"block_size": 4, "max_model_len": 64}
    draft = {**DRAFT, "model": str(tiny_model_dir)}
    small = LLM(
        str(tiny_model_dir),
        **common,
        num_kv_blocks=17,
        max_num_seqs=3,
        preemption_mode="swap",
        swap_space=0.01,
        speculative_config=draft,
    )
    got = [[c.token_ids for c in o.outputs] for o in run(small, prompts, params)]
    want = [
        [c.token_ids for c in o.outputs]
        for o in run(LLM(str(tiny_model_dir), **common, num_kv_blocks=256), prompts, params)
    ]
    assert got == want
    stats = small.engine.stats
    assert stats.preemptions > 0 and stats.spec_accepted_tokens > 0 and stats.prefix_cache_hits > 0


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_model_dir, tmp_path):
    from kvpilot.engine.model.tiny import write_tiny_llama

    draft = write_tiny_llama(tmp_path / "d", seed=1, vocab_size=384)
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        LLM(str(tiny_model_dir), num_kv_blocks=64, speculative_config={**DRAFT, "model": str(draft)})


def test_a_draft_model_with_a_shorter_context_is_refused(tiny_model_dir, tmp_path):
    from kvpilot.engine.model.tiny import write_tiny_llama

    draft = write_tiny_llama(tmp_path / "d", seed=1, max_position_embeddings=64)
    with pytest.raises(ValueError, match="the draft model serves 64 positions"):
        LLM(str(tiny_model_dir), num_kv_blocks=64, speculative_config={**DRAFT, "model": str(draft)})


def test_speculation_switches_off_above_its_batch_size(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=512, speculative_config={**SPEC, "disable_by_batch_size": 3})
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    run(llm, repetitive_prompts(9, 4), params)  # four decoding at once: above the switch-off
    assert llm.engine.stats.spec_draft_tokens == 0
    run(llm, repetitive_prompts(9, 3), params)
    assert llm.engine.stats.spec_draft_tokens > 0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs 'model'"),
        ('{"num_speculative_tokens": 2, "model": "tiny-random"}', "belongs to method 'draft_model'"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be >= 1"),
        (
            '{"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2}',
            "prompt_lookup_min",
        ),
        ('{"num_speculative_tokens": 2, "typo": 1}', "unknown key"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_speculative_config_is_a_clear_error(value: str, message: str):
    with pytest.raises(ConfigError, match=message):
        EngineArgs(model="tiny-random", speculative_config=value).create_config()
