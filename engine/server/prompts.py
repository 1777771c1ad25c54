"""Request body → prompt token ids, by exactly the rules the router applies (``router/request_profile.py``),
through the same shared functions (``kvpilot.engine.prompt_render``), so the router's block hashes are the
engine's (tests/server/test_prompt_ids.py holds them equal):

- completions ``prompt``: a string, a list of token ids, a list of strings, or a list of token-id lists;
- chat: ``messages`` through the model's chat template with ``add_generation_prompt`` (default true),
  ``chat_template_kwargs`` as template variables, and ``tools`` (when the body has the key) on top.

Tokenization runs on a worker thread (it can take milliseconds for long prompts); any failure to render
or encode is the request's fault: 400. Each text passes ``check_length`` first, which refuses one that is
certainly too long without encoding it (``kvpilot.engine.prompt_bound``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpilot.engine.prompt_render import completion_prompt_ids, encode_chat_prompt, render_chat_prompt
from kvpilot.engine.server.errors import APIError, bad_request
from kvpilot.engine.server.protocol import ChatCompletionRequest
from kvpilot.engine.tokenizer import Tokenizer

# apply_chat_template's own parameters: as template variables they would change how it runs.
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "tokenize"})
#: raises an ``APIError`` for a prompt text that must not be encoded
CheckLength = Callable[[str], None]


def _unchecked(text: str) -> None:
    pass


@dataclass(frozen=True)
class PromptInput:
    #: the prompt as text, when the client sent text (for ``echo``); None for token ids
    text: str | None
    token_ids: list[int]


def holds_token_ids(prompt: str | list) -> bool:
    """Whether a completions ``prompt`` is token ids (one list of them or several), not text; the body's
    type allows no mixed list."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], str)


def check_prompt_count(prompt: str | list, max_prompts: int) -> None:
    """Several prompts are one batch of that many requests, admitted whole into a queue that holds
    ``max_prompts`` (``--max-queue-len``): a larger batch could never be admitted, so it is refused (400)
    before any of its prompts is checked or encoded, not told to retry (429)."""
    several = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    count = len(prompt) if several else 1
    if count > max_prompts:
        raise bad_request(
            f"prompt holds {count} prompts; this server queues at most {max_prompts} requests "
            "(--max-queue-len), and a request's prompts are queued together: send at most "
            f"{max_prompts} prompts per request",
            "prompt",
        )


def completion_prompts(
    tokenizer: Tokenizer, prompt: str | list, check_length: CheckLength = _unchecked
) -> list[PromptInput]:
    if isinstance(prompt, str):
        prompt = [prompt]
    elif not prompt:
        raise bad_request("prompt must not be an empty list", "prompt")
    elif all(isinstance(t, int) for t in prompt):
        return [PromptInput(None, completion_prompt_ids(tokenizer, prompt))]
    for p in prompt:  # every text before any is encoded: one huge prompt of several costs nothing
        if isinstance(p, str):
            check_length(p)
    return [
        PromptInput(p if isinstance(p, str) else None, completion_prompt_ids(tokenizer, p)) for p in prompt
    ]


def chat_template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    kwargs = dict(body.chat_template_kwargs or {})
    clash = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if clash:
        raise bad_request(f"chat_template_kwargs may not set {clash}", "chat_template_kwargs")
    if "tools" in body.model_fields_set:
        kwargs["tools"] = body.tools
    return kwargs


def chat_prompt(
    tokenizer: Tokenizer, body: ChatCompletionRequest, check_length: CheckLength = _unchecked
) -> PromptInput:
    kwargs = chat_template_kwargs(body)
    add_generation_prompt = True if body.add_generation_prompt is None else body.add_generation_prompt
    try:
        text = render_chat_prompt(tokenizer, body.messages, add_generation_prompt, **kwargs)
        check_length(text)
        ids = encode_chat_prompt(tokenizer, text)
    except APIError:
        raise
    except Exception as err:  # the template decides what it accepts; whatever it refuses is bad input
        raise bad_request(
            f"messages could not be rendered with the model's chat template: {err}", "messages"
        ) from None
    return PromptInput(None, ids)
