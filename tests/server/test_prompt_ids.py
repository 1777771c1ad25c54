"""The server derives exactly the prompt token ids the router derives for the same body (so the router's
block hashes are the engine's): completions prompts in all four forms, chat with add_generation_prompt,
chat_template_kwargs, tools and tool turns (tool_calls, tool messages), on the tiny model and on SmolLM2's
real chat template."""

from __future__ import annotations

import pytest

from kvpilot.engine.server.prompts import chat_prompt, completion_prompts
from kvpilot.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from kvpilot.engine.tokenizer import Tokenizer
from kvpilot.router.request_profile import CHAT_COMPLETIONS, COMPLETIONS
from kvpilot.router.server import load_profiler

MESSAGES = [
    {"role": "system", "content": "You answer briefly. " * 10},
    {"role": "user", "content": "What is a KV cache? ünïcode ✓ 🚀"},
    {"role": "assistant", "content": "Keys and values of past tokens."},
    {"role": "user", "content": "and <|im_start|> inside text?"},
]
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "kv"}'}}
TOOL_TURNS = [
    MESSAGES[1],
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "keys and values"},
]
BODIES = [
    (COMPLETIONS, {"prompt": "Once upon a time"}),
    (COMPLETIONS, {"prompt": "special <|im_end|> tokens <|endoftext|> in text"}),
    (COMPLETIONS, {"prompt": ["a b", "c d", ""]}),
    (COMPLETIONS, {"prompt": [1, 2, 3]}),
    (COMPLETIONS, {"prompt": [[5, 6], [7]]}),
    (CHAT_COMPLETIONS, {"messages": MESSAGES}),
    (CHAT_COMPLETIONS, {"messages": MESSAGES, "add_generation_prompt": False}),
    (CHAT_COMPLETIONS, {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}),
    (CHAT_COMPLETIONS, {"messages": MESSAGES, "tools": TOOLS}),
    (CHAT_COMPLETIONS, {"messages": MESSAGES, "tools": None}),
    (CHAT_COMPLETIONS, {"messages": TOOL_TURNS, "tools": TOOLS}),
    (CHAT_COMPLETIONS, {"messages": MESSAGES[1:2]}),
    (
        CHAT_COMPLETIONS,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "a KV cache?"}],
                }
            ]
        },
    ),
]


def server_prompt_ids(tokenizer: Tokenizer, path: str, body: dict) -> tuple[list[int], ...]:
    if path == COMPLETIONS:
        return tuple(p.token_ids for p in completion_prompts(tokenizer, CompletionRequest(**body).prompt))
    return (chat_prompt(tokenizer, ChatCompletionRequest(**body)).token_ids,)


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def tokenizers(request):
    model_dir = request.getfixturevalue("tiny_model_dir" if request.param == "tiny" else "smollm2_dir")
    return Tokenizer.from_dir(model_dir), load_profiler(str(model_dir))


@pytest.mark.parametrize(
    ("path", "body"), BODIES, ids=[f"{p.rsplit('/', 1)[1]}-{i}" for i, (p, _) in enumerate(BODIES)]
)
def test_server_and_router_derive_the_same_prompt_ids(tokenizers, path, body):
    tokenizer, profiler = tokenizers
    router_ids = tuple(
        list(ids) for ids in profiler.profile(path, body, tenant="t").prompts
    )  # chat: array("I")
    assert server_prompt_ids(tokenizer, path, body) == router_ids


def test_content_parts_are_joined_text_and_other_parts_are_refused(tokenizers):
    tokenizer, _ = tokenizers
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "it?"}]}
    ]
    plain = [{"role": "user", "content": "What is\nit?"}]
    assert server_prompt_ids(tokenizer, CHAT_COMPLETIONS, {"messages": parts}) == server_prompt_ids(
        tokenizer, CHAT_COMPLETIONS, {"messages": plain}
    )
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(Exception, match="only text content parts"):
        server_prompt_ids(tokenizer, CHAT_COMPLETIONS, {"messages": image})
