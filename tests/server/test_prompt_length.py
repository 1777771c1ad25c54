"""A prompt whose length alone proves it beyond the context is refused before it is tokenized (an 8 MB
prompt took ~6 s of tokenizing on one core before the token check refused it); one just under the character
bound is tokenized and checked by its token count as before. tiny-random: 512-token context, at most 13
characters per token (``<|endoftext|>``), so 511 × 13 = 6643 characters is the longest text tokenized."""

from __future__ import annotations

import httpx
import pytest

from kvpilot.engine.prompt_render import chat_prompt_ids, render_chat_prompt

MAX_MODEL_LEN, PER_TOKEN = 512, 13
LONGEST_TOKENIZED = (MAX_MODEL_LEN - 1) * PER_TOKEN  # 6643: ceil(6643 / 13) = 511 tokens at least


@pytest.fixture(scope="module")
def server(start_in_process):
    return start_in_process()


@pytest.fixture
def encoded(server, monkeypatch) -> list[str]:
    """Every text the server's tokenizer encodes during the test."""
    tokenizer = server.state.info.tokenizer
    texts: list[str] = []
    encode = tokenizer.encode

    def spy(text: str, add_special_tokens: bool = True) -> list[int]:
        texts.append(text)
        return encode(text, add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode", spy)
    return texts


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def context_error(message: str) -> dict:
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": "prompt",
            "code": "context_length_exceeded",
        }
    }


def test_security_an_8_mb_prompt_is_refused_by_its_length_without_tokenizing(server, encoded) -> None:
    prompt = "hello world " * 666_666  # 7,999,992 characters
    response = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert (response.status_code, response.json()) == (
        400,
        context_error(
            "prompt has at least 615384 tokens (7999992 characters, at most 13 per token); "
            "the context limit is 512 (prompt + at least one generated token)"
        ),
    )
    assert encoded == []


def test_security_an_8_mb_chat_message_is_refused_by_its_rendered_length_without_tokenizing(
    server, encoded, tiny_tokenizer
) -> None:
    messages = [{"role": "user", "content": "hello world " * 666_666}]
    chars = len(render_chat_prompt(tiny_tokenizer, messages))
    assert chars == 7_999_992 + 106  # the template adds a system prompt and the role markers
    response = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert (response.status_code, response.json()) == (
        400,
        context_error(
            f"prompt has at least 615393 tokens ({chars} characters, at most 13 per token); "
            "the context limit is 512 (prompt + at least one generated token)"
        ),
    )
    assert encoded == []


def test_security_one_huge_prompt_among_several_stops_them_all_before_any_is_tokenized(
    server, encoded
) -> None:
    response = post(
        server, "/v1/completions", {"prompt": ["short", "a" * (LONGEST_TOKENIZED + 1)], "max_tokens": 1}
    )
    assert (response.status_code, response.json()) == (
        400,
        context_error(
            "prompt has at least 512 tokens (6644 characters, at most 13 per token); "
            "the context limit is 512 (prompt + at least one generated token)"
        ),
    )
    assert encoded == []


def test_a_prompt_just_under_the_bound_is_tokenized_and_checked_by_its_tokens(
    server, encoded, tiny_tokenizer
) -> None:
    prompt = "a" * LONGEST_TOKENIZED
    tokens = len(tiny_tokenizer.encode(prompt))
    response = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert (response.status_code, response.json()) == (
        400,
        context_error(
            f"prompt has {tokens} tokens; the context limit is 512 (prompt + at least one generated token)"
        ),
    )
    assert encoded == [prompt]


def test_prompts_within_the_bound_are_answered(server, encoded, tiny_tokenizer) -> None:
    chars = (LONGEST_TOKENIZED // len("<|endoftext|>")) * "<|endoftext|>"  # 511 tokens in 6643 characters
    assert (len(chars), len(tiny_tokenizer.encode(chars))) == (LONGEST_TOKENIZED, 511)
    response = post(server, "/v1/completions", {"prompt": chars, "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 511
    messages = [{"role": "user", "content": "hi"}]
    response = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(chat_prompt_ids(tiny_tokenizer, messages))
    assert encoded == [chars, render_chat_prompt(tiny_tokenizer, messages)]
