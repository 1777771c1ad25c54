"""The router derives exactly the engine's prompt ids and block hashes (shared functions), including through
its segment token cache, and routes what it cannot tokenize without locality instead of rejecting it."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.engine.kv.block_hash import block_hashes, encode_extra_keys, root_hash
from kvpilot.engine.prompt_bound import max_chars_per_token
from kvpilot.engine.prompt_render import chat_prompt_ids, completion_prompt_ids
from kvpilot.router.block_chain import BlockChain
from kvpilot.router.request_profile import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    MAX_PROFILED_CHARS,
    MAX_PROFILED_PROMPTS,
    PromptError,
)
from kvpilot.router.segment_tokenizer import SegmentTokenizer

ROOT = root_hash("test-model")
MESSAGES = [
    {"role": "system", "content": "You answer briefly. " * 20},
    {"role": "user", "content": "What is a KV cache?"},
    {"role": "assistant", "content": "Keys and values of past tokens."},
    {"role": "user", "content": "and <|im_start|> inside text?"},
]


def test_chat_and_completion_ids_equal_the_engines(tiny_profiler, tiny_tokenizer):
    chat = tiny_profiler.profile(CHAT_COMPLETIONS, {"messages": MESSAGES}, tenant=None)
    assert list(chat.prompts[0]) == chat_prompt_ids(tiny_tokenizer, MESSAGES)
    again = tiny_profiler.profile(CHAT_COMPLETIONS, {"messages": MESSAGES}, tenant=None)  # from the cache
    assert again.prompts == chat.prompts
    no_generation = tiny_profiler.profile(
        CHAT_COMPLETIONS, {"messages": MESSAGES, "add_generation_prompt": False}, tenant=None
    )
    assert list(no_generation.prompts[0]) == chat_prompt_ids(
        tiny_tokenizer, MESSAGES, add_generation_prompt=False
    )
    text = tiny_profiler.profile(COMPLETIONS, {"prompt": "Once upon a time"}, tenant=None)
    assert text.prompts == (completion_prompt_ids(tiny_tokenizer, "Once upon a time"),)
    batch = tiny_profiler.profile(
        COMPLETIONS, {"prompt": ["a b", "c d"], "max_tokens": 5, "n": 2}, tenant=None
    )
    assert batch.prompts == tuple(completion_prompt_ids(tiny_tokenizer, p) for p in ("a b", "c d"))
    assert (batch.max_output_tokens, batch.prompt_tokens) == (10, sum(len(p) for p in batch.prompts))
    ids = tiny_profiler.profile(COMPLETIONS, {"prompt": [[5, 6, 7], [8]]}, tenant=None)
    assert ids.prompts == ([5, 6, 7], [8])


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT_COMPLETIONS, {}),
        (CHAT_COMPLETIONS, {"messages": []}),
        (CHAT_COMPLETIONS, {"messages": "hi"}),
        (CHAT_COMPLETIONS, {"messages": MESSAGES, "chat_template_kwargs": []}),
        (CHAT_COMPLETIONS, {"messages": [{"role": "user"}]}),
        (COMPLETIONS, {}),
        (COMPLETIONS, {"prompt": 3}),
        (COMPLETIONS, {"prompt": ["a", 1]}),
        (COMPLETIONS, {"prompt": [-1]}),
        (COMPLETIONS, {"prompt": []}),
    ],
)
def test_bodies_without_a_usable_prompt_raise_prompt_error(tiny_profiler, path, body):
    with pytest.raises(PromptError):
        tiny_profiler.profile(path, body, tenant=None)


def test_block_hashes_equal_the_engines_and_are_salted_per_tenant(tiny_profiler):
    body = {"messages": MESSAGES}
    shared, acme = (tiny_profiler.profile(CHAT_COMPLETIONS, body, tenant=t) for t in (None, "acme"))
    ids = shared.prompts[0]
    assert shared.chains(ROOT, 16)[0].all_hashes() == block_hashes(ids, 16, ROOT)
    assert acme.chains(ROOT, 16)[0].all_hashes() == block_hashes(
        ids, 16, ROOT, encode_extra_keys(cache_salt="acme")
    )
    assert not set(acme.chains(ROOT, 16)[0].all_hashes()) & set(shared.chains(ROOT, 16)[0].all_hashes())
    assert acme.tie_key(16) != shared.tie_key(16)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 511), max_size=200), st.sampled_from([1, 4, 16]), st.binary(max_size=8))
def test_a_lazy_chain_is_the_shared_block_hash_chain(tokens, block_size, extra):
    chain = BlockChain(tokens, block_size, ROOT, extra)
    expected = block_hashes(tokens, block_size, ROOT, extra)
    held = set(expected[: len(expected) // 2])
    assert chain.cached_blocks(held) == min(len(held), chain.hittable_blocks)
    assert [chain.hash_at(i) for i in reversed(range(len(expected)))] == expected[::-1]
    assert chain.all_hashes() == expected
    assert chain.hittable_blocks == (max(len(tokens), 1) - 1) // block_size


SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start", "|>"]
texts = st.lists(
    st.one_of(st.text(max_size=80), st.sampled_from(SPECIALS), st.sampled_from([" ", "\n", "\n\n"])),
    max_size=12,
).map("".join)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(texts, min_size=1, max_size=4))
def test_segment_cache_encodes_exactly_like_the_tokenizer(tiny_tokenizer, tiny_model_dir, pieces):
    segments = SegmentTokenizer(tiny_tokenizer, tiny_model_dir, max_cached_stretches=16)
    assert segments.segmenting
    for text in pieces + pieces:  # the second round comes from the cache
        assert list(segments.encode_rendered(text)) == tiny_tokenizer.encode(text, add_special_tokens=False)


def test_segment_cache_stays_within_its_token_budget(tiny_tokenizer, tiny_model_dir):
    segments = SegmentTokenizer(
        tiny_tokenizer, tiny_model_dir, max_cached_tokens=400, max_cached_stretches=20
    )
    for i in range(30):
        segments.encode_rendered(f"<|im_start|>system\nprompt number {i} " * 3 + "<|im_end|>")
    stretches, tokens = segments.cache_size
    assert 0 < tokens <= 400 and stretches <= 20


def test_tokenizers_whose_added_tokens_strip_whitespace_are_encoded_whole(
    tiny_tokenizer, tiny_model_dir, tmp_path
):
    spec = (tiny_model_dir / "tokenizer.json").read_text()
    (tmp_path / "tokenizer.json").write_text(spec.replace('"lstrip": false', '"lstrip": true', 1))
    segments = SegmentTokenizer(tiny_tokenizer, tmp_path)
    assert not segments.segmenting
    assert list(segments.encode_rendered("a<|im_end|> b")) == tiny_tokenizer.encode(
        "a<|im_end|> b", add_special_tokens=False
    )


@pytest.mark.slow
def test_segment_cache_matches_smollm2s_tokenizer_on_chat_prompts(smollm2_dir):
    from kvpilot.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(smollm2_dir)
    segments = SegmentTokenizer(tokenizer, smollm2_dir)
    for messages in (MESSAGES, [{"role": "user", "content": "héllo  wörld\n\n  tabs\tand spaces  "}]):
        text = tokenizer.apply_chat_template(messages)
        assert list(segments.encode_rendered(text)) == chat_prompt_ids(tokenizer, messages)


def test_router_hashes_equal_the_blocks_a_real_engine_caches(tiny_profiler):
    from kvpilot.engine import EngineArgs, LLMEngine, SamplingParams

    engine = LLMEngine(EngineArgs.from_kwargs(model="tiny-random", num_kv_blocks=64).create_config())
    body = {"messages": MESSAGES}
    profile = tiny_profiler.profile(CHAT_COMPLETIONS, body, tenant="acme")
    engine.add_request("r1", list(profile.prompts[0]), SamplingParams(max_tokens=2), cache_salt="acme")
    while engine.has_unfinished_requests():
        engine.step()
    stored = {h for e in engine.kv_events.since(0).events if e.kind == "stored" for h in e.hashes}
    router_hashes = [
        h.hex() for h in profile.chains(engine.kv.root_hash, engine.kv.block_size)[0].all_hashes()
    ]
    assert router_hashes and set(router_hashes) <= stored


def test_a_hit_test_hashes_only_as_far_as_the_first_miss(monkeypatch):
    from kvpilot.router import block_chain

    hashed = []
    real = block_chain.hash_block_bytes
    monkeypatch.setattr(block_chain, "hash_block_bytes", lambda *a: hashed.append(1) or real(*a))
    tokens = list(range(40 * 4 + 1))  # 40 hittable blocks of 4
    expected = block_hashes(tokens, 4, ROOT)
    chain = BlockChain(tokens, 4, ROOT, b"")
    assert chain.cached_blocks(set(expected[:10])) == 10
    assert len(hashed) == 11  # the ten held blocks and the first missing one; the 29 after it never
    assert chain.cached_blocks(set()) == 0 and len(hashed) == 11  # hashes are computed once
    hashed.clear()
    assert BlockChain(tokens, 4, ROOT, b"").cached_blocks(set()) == 0 and hashed == [1]  # a new prefix
    assert BlockChain(tokens, 4, ROOT, b"").cached_blocks(set(expected)) == 40
    held_late = set(expected) - {expected[3]}
    assert BlockChain(tokens, 4, ROOT, b"").cached_blocks(held_late) == 3


def test_security_a_text_longer_than_every_context_is_not_tokenized(tiny_model_dir, monkeypatch):
    """Once replicas report their context limit, a prompt whose characters alone prove it too long is
    refused before tokenizing (routed without locality; the engine answers 400 without tokenizing it)."""
    from kvpilot.router import request_profile
    from kvpilot.router.server import load_profiler

    profiler = load_profiler(str(tiny_model_dir))
    calls = []
    real = request_profile.completion_prompt_ids
    monkeypatch.setattr(request_profile, "completion_prompt_ids", lambda *a: calls.append(1) or real(*a))
    huge = {"prompt": "word " * 200_000, "max_tokens": 1}
    profiler.profile(COMPLETIONS, {"prompt": "short", "max_tokens": 1}, None)  # no limit known: tokenized
    assert calls == [1]
    profiler.context_limit = lambda: 512
    with pytest.raises(PromptError, match="1000000 characters cannot fit a 512-token context"):
        profiler.profile(COMPLETIONS, huge, None)
    with pytest.raises(PromptError, match="cannot fit a 512-token context"):
        profiler.profile(
            CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": "word " * 200_000}]}, None
        )
    assert calls == [1]  # neither huge prompt reached the tokenizer
    assert profiler.profile(
        COMPLETIONS, {"prompt": "short", "max_tokens": 1}, None
    ).prompts  # small ones still


def test_security_a_batch_is_profiled_only_within_one_requests_bounded_work(tiny_model_dir, monkeypatch):
    """The length check bounds the whole request, not each text: many texts that each fit a context (the
    probe's 160 of 47k characters, 7.5 MB, ~3 s of tokenizing on the event loop) are routed without
    locality, untokenized, like one text that cannot fit; so is a batch of more than MAX_PROFILED_PROMPTS
    prompts or of more than MAX_PROFILED_CHARS characters while no context limit is known."""
    from kvpilot.router import request_profile
    from kvpilot.router.server import load_profiler

    profiler = load_profiler(str(tiny_model_dir))
    calls = []
    real = request_profile.completion_prompt_ids
    monkeypatch.setattr(request_profile, "completion_prompt_ids", lambda *a: calls.append(1) or real(*a))
    fits = "x" * (511 * max_chars_per_token(profiler._tokenizer))  # alone, it may fit 512 tokens
    profiler.context_limit = lambda: 512
    assert profiler.profile(COMPLETIONS, {"prompt": [fits]}, None).prompts and calls == [1]
    with pytest.raises(PromptError, match=f"2 prompts of {2 * len(fits)} characters in all"):
        profiler.profile(COMPLETIONS, {"prompt": [fits, fits]}, None)
    profiler.context_limit = lambda: None
    many = ["a"] * MAX_PROFILED_PROMPTS
    assert len(profiler.profile(COMPLETIONS, {"prompt": many}, None).prompts) == MAX_PROFILED_PROMPTS
    calls.clear()
    with pytest.raises(PromptError, match=f"{MAX_PROFILED_PROMPTS + 1} prompts"):
        profiler.profile(COMPLETIONS, {"prompt": [*many, "a"]}, None)
    with pytest.raises(PromptError, match=f"{MAX_PROFILED_PROMPTS + 1} prompts"):
        profiler.profile(COMPLETIONS, {"prompt": [[1]] * (MAX_PROFILED_PROMPTS + 1)}, None)
    half = "y" * (MAX_PROFILED_CHARS // 2 + 1)
    with pytest.raises(PromptError, match=f"2 prompts of {2 * len(half)} characters in all"):
        profiler.profile(COMPLETIONS, {"prompt": [half, half]}, None)
    with pytest.raises(PromptError, match=f"characters: over the {MAX_PROFILED_CHARS} the router tokenizes"):
        profiler.profile(CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": half * 2}]}, None)
    assert calls == []  # none of them reached the tokenizer
