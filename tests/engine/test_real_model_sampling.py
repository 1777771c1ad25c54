"""Issue 3's real-model checks through ``LLM.generate`` on SmolLM2-135M (default run)."""

from __future__ import annotations

import pytest
from engine_device import ENGINE_DEVICE

from kvpilot.engine import LLM, SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY_ANSWER = "The capital of France is Paris."


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(str(smollm2_dir), kv_cache_memory_bytes=96 << 20, block_size=16, **ENGINE_DEVICE)


def chat(llm, **kw):
    return llm.chat(QUESTION, SamplingParams(**{"temperature": 0.0, "max_tokens": 24, **kw}))[0]


def test_greedy_baseline_and_bad_words_removes_the_word(llm):
    assert chat(llm).outputs[0].text == GREEDY_ANSWER
    banned = chat(llm, bad_words=["Paris"]).outputs[0].text
    assert "Paris" not in banned and banned.startswith("The capital of France is")


def test_logit_bias_forces_a_token(llm):
    tok = llm.get_tokenizer()
    forced = tok.encode(" banana", add_special_tokens=False)
    assert len(forced) == 1
    out = chat(llm, logit_bias={forced[0]: 100}, max_tokens=3).outputs[0]
    assert out.token_ids == forced * 3


def test_min_tokens_delays_eos(llm):
    short = chat(llm).outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 20
    longer = chat(llm, min_tokens=20, max_tokens=40).outputs[0]
    assert len(longer.token_ids) >= 20 and longer.text.startswith(GREEDY_ANSWER)


def test_n3_shares_the_prompt_blocks(llm):
    engine = llm.engine
    tok = llm.get_tokenizer()
    from kvpilot.engine.prompt_render import chat_prompt_ids

    prompt = chat_prompt_ids(tok, QUESTION)
    engine.add_request(
        "n3", prompt, SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=8, ignore_eos=True)
    )
    engine.step()
    tables = [engine.kv.block_table(s.seq) for s in engine.groups["n3"].samples]
    prompt_blocks = -(-len(prompt) // 16)
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == prompt_blocks
    assert engine.pool.num_in_use == prompt_blocks  # one copy of the prompt for three samples
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.pool.num_in_use == 0


def test_stop_string_spanning_three_tokens_never_leaks_while_streaming(llm):
    engine = llm.engine
    tok = llm.get_tokenizer()
    from kvpilot.engine.prompt_render import chat_prompt_ids

    stop = "of France is"  # " of", " France", " is": three tokens
    assert len(tok.encode(" " + stop, add_special_tokens=False)) == 3
    engine.add_request(
        "stream", chat_prompt_ids(tok, QUESTION), SamplingParams(temperature=0.0, max_tokens=24, stop=[stop])
    )
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append(out.outputs[0].text)
    final = seen[-1]
    assert final == "The capital "
    assert all(final.startswith(text) for text in seen)  # no intermediate text ever showed part of the stop
    assert engine.terminal_records[-1].finish_reason == "stop"
