"""The OpenAI endpoints of a live ``kvpilot serve`` (tiny model, subprocess), driven by the official
``openai`` client: shapes, streaming, n, logprobs, stop strings across tokens, seeds, vLLM's extras."""

from __future__ import annotations

import json

import httpx
import pytest

from kvpilot.engine.prompt_render import chat_prompt_ids, completion_prompt_ids

pytestmark = pytest.mark.e2e
MODEL = "tiny-random"
GREEDY = {"temperature": 0.0}
FIXED_LEN = {"ignore_eos": True}  # the random model may sample EOS; these tests want exact lengths
MESSAGES = [{"role": "user", "content": "Tell me about paged attention."}]


def test_completion_shape_and_usage(client, tiny_tokenizer):
    out = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, extra_body=FIXED_LEN
    )
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    (choice,) = out.choices
    assert (choice.index, choice.finish_reason, choice.logprobs) == (0, "length", None)
    assert out.usage.prompt_tokens == len(completion_prompt_ids(tiny_tokenizer, "Once upon a time"))
    assert (out.usage.completion_tokens, out.usage.total_tokens) == (5, out.usage.prompt_tokens + 5)


def test_completion_default_max_tokens_is_16(client):
    out = client.completions.create(model=MODEL, prompt="a b c", extra_body=FIXED_LEN)
    assert out.usage.completion_tokens == 16


def test_chat_shape_and_prompt_ids(client, tiny_tokenizer):
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=4, extra_body=FIXED_LEN
    )
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    (choice,) = out.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(chat_prompt_ids(tiny_tokenizer, MESSAGES))
    assert out.usage.completion_tokens == 4


def test_streaming_completion_matches_non_streaming(client):
    kwargs = {
        "model": MODEL,
        "prompt": "The quick brown fox",
        "max_tokens": 12,
        **GREEDY,
        "extra_body": FIXED_LEN,
    }
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    *content, last = chunks
    assert "".join(c.choices[0].text for c in content) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.usage is None for c in content)
    assert (last.choices, last.usage.completion_tokens) == ([], 12)
    assert last.usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_stream_first_chunk_carries_role_and_first_token(client):
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, **GREEDY, "extra_body": FIXED_LEN}
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content  # coalesced: the role never travels alone
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == full.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 6


def test_n2_gives_two_seeded_samples(client):
    kwargs = {
        "model": MODEL,
        "prompt": "Paged KV",
        "max_tokens": 8,
        "n": 2,
        "seed": 7,
        "temperature": 1.0,
        "extra_body": FIXED_LEN,
    }
    out = client.completions.create(**kwargs)
    assert [c.index for c in out.choices] == [0, 1] and out.usage.completion_tokens == 16
    assert out.choices[0].text != out.choices[1].text
    again = client.completions.create(**kwargs)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    streamed = list(client.completions.create(stream=True, **kwargs))
    for i in (0, 1):
        assert "".join(c.choices[0].text for c in streamed if c.choices[0].index == i) == out.choices[i].text


def test_seed_reproducibility(client):
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=MODEL, prompt="Seeds", max_tokens=16, temperature=1.0, seed=seed, extra_body=FIXED_LEN
            )
            .choices[0]
            .text
        )

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_completion_logprobs(client):
    out = client.completions.create(
        model=MODEL, prompt="Log probs", max_tokens=5, logprobs=3, **GREEDY, extra_body=FIXED_LEN
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) >= 1 and logprob <= 0
        assert logprob == max(top.values())  # greedy: the sampled token is the most likely one
        assert top[token] == logprob
    assert lp.text_offset[0] == 0


def test_chat_logprobs_and_top_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
        extra_body=FIXED_LEN,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == item.top_logprobs[0].logprob and item.bytes == list(item.token.encode())


def test_stop_string_spanning_tokens(client):
    base = {"model": MODEL, "prompt": "Stop strings", "max_tokens": 24, **GREEDY}
    probe = client.completions.create(logprobs=0, extra_body=FIXED_LEN, **base)
    tokens, text = probe.choices[0].logprobs.tokens, probe.choices[0].text
    assert "".join(tokens) == text
    # a stop string made of the end of token 5, all of token 6 and the start of token 7
    start = next(i for i in range(4, len(tokens) - 3) if tokens[i] and tokens[i + 1] and tokens[i + 2])
    stop = tokens[start][-1] + tokens[start + 1] + tokens[start + 2][:1]
    cut = text.index(stop)
    out = client.completions.create(stop=[stop], extra_body=FIXED_LEN, **base)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (text[:cut], "stop")
    assert out.choices[0].model_extra["stop_reason"] == stop
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(stop=[stop], stream=True, extra_body=FIXED_LEN, **base)
    )
    assert streamed == text[:cut] and stop not in streamed
    included = client.completions.create(
        stop=[stop], **base, extra_body={**FIXED_LEN, "include_stop_str_in_output": True}
    )
    assert included.choices[0].text == text[:cut] + stop


def test_several_prompts_and_token_id_prompts(client, tiny_tokenizer):
    ids = completion_prompt_ids(tiny_tokenizer, "second prompt")
    out = client.completions.create(
        model=MODEL,
        prompt=["first prompt", "second prompt"],
        n=2,
        max_tokens=3,
        extra_body=FIXED_LEN,
        **GREEDY,
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    by_ids = client.completions.create(
        model=MODEL, prompt=[[1, 2, 3], ids], max_tokens=3, extra_body=FIXED_LEN, **GREEDY
    )
    # greedy: the same prompt gives the same text, as text or as token ids, and for both samples
    assert by_ids.choices[1].text == out.choices[2].text == out.choices[3].text
    assert by_ids.usage.prompt_tokens == 3 + len(ids)


def test_echo_prepends_the_prompt(client):
    kwargs = {"model": MODEL, "prompt": "Echo me", "max_tokens": 3, "extra_body": FIXED_LEN, **GREEDY}
    out = client.completions.create(echo=True, **kwargs)
    plain = client.completions.create(**kwargs)
    assert out.choices[0].text == "Echo me" + plain.choices[0].text


def test_vllm_extra_sampling_params(client, tiny_tokenizer):
    token = tiny_tokenizer.encode("e", add_special_tokens=False)[0]
    out = client.completions.create(
        model=MODEL,
        prompt="Constrained",
        max_tokens=4,
        logprobs=0,
        extra_body={"allowed_token_ids": [token], **FIXED_LEN},
    )
    lp = out.choices[0].logprobs
    assert lp.tokens == [tiny_tokenizer.decode([token], skip_special_tokens=False)] * 4
    top1 = client.completions.create(
        model=MODEL,
        prompt="top k",
        max_tokens=6,
        temperature=1.0,
        seed=3,
        extra_body={"top_k": 1, **FIXED_LEN},
    )
    greedy = client.completions.create(
        model=MODEL, prompt="top k", max_tokens=6, extra_body=FIXED_LEN, **GREEDY
    )
    assert top1.choices[0].text == greedy.choices[0].text
    stopped = client.completions.create(
        model=MODEL,
        prompt="Constrained",
        max_tokens=8,
        extra_body={"allowed_token_ids": [token], "stop_token_ids": [token], **FIXED_LEN},
    )
    assert (stopped.usage.completion_tokens, stopped.choices[0].finish_reason) == (1, "stop")
    assert stopped.choices[0].model_extra["stop_reason"] == token


def test_best_of_picks_n_and_user_is_accepted(client):
    out = client.completions.create(
        model=MODEL,
        prompt="best of",
        max_tokens=4,
        n=1,
        best_of=3,
        seed=5,
        temperature=1.0,
        user="user-42",
        extra_body=FIXED_LEN,
    )
    assert [c.index for c in out.choices] == [0] and out.usage.completion_tokens == 4


def test_models_endpoint(client, tiny_server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == 512


def test_raw_http_stream_is_sse_with_done(tiny_server):
    body = {"prompt": "raw", "max_tokens": 2, "ignore_eos": True, "temperature": 0}
    full = tiny_server.post("/v1/completions", body).json()["choices"][0]["text"]
    with httpx.stream(
        "POST",
        tiny_server.url + "/v1/completions",
        headers=tiny_server.headers,
        json={**body, "stream": True},
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in events[:-2])
    # the greedy text of this prompt starts with a token that ends inside a UTF-8 character: its bytes are
    # held back and leave with the next token, so two tokens make one chunk (and one emit)
    assert len(events) == 3 and json.loads(events[0][6:])["choices"][0]["text"] == full


@pytest.mark.parametrize("path", ["/health", "/ready", "/load", "/metrics", "/v1/models"])
def test_head_answers_as_get_without_a_body(tiny_server, path):
    """A probe or load balancer asking with HEAD got 405 (FastAPI's ``get`` routes GET alone)."""
    got, head = tiny_server.get(path), httpx.head(tiny_server.url + path, headers=tiny_server.headers)
    assert (head.status_code, head.content) == (got.status_code, b"")
    assert head.headers["content-type"] == got.headers["content-type"]
    if path != "/metrics":  # a scrape's counters move between the two requests
        assert head.headers["content-length"] == str(len(got.content))
