"""Prompt → token ids exactly as the engine server does it; the router imports the same functions so its
block hashes match the engine's (no torch here). Tools and tool messages go through ``tool_prompt`` first
(rewritten into the prompt for templates that do not render them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpilot.engine.tokenizer import Tokenizer
from kvpilot.engine.tool_prompt import prepare_tool_messages, renders_tools


def completion_prompt_ids(tokenizer: Tokenizer, prompt: str | Sequence[int]) -> list[int]:
    """``/v1/completions``: a string is encoded with the tokenizer's special tokens; ids pass through."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=True)
    return [int(t) for t in prompt]


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI content-part arrays (``[{"type": "text", "text": ...}, ...]``) become the string the chat
    templates expect: the text parts joined by newlines, as vLLM does. Other part types (images, audio)
    are refused: these models read text only."""
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"only text content parts are supported, got a {kind!r} part")
                texts.append(part["text"])
            message = {**message, "content": "\n".join(texts)}
        out.append(message)
    return out


def render_chat_prompt(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> str:
    """The chat prompt text: content parts normalized, tools prepared (``tool_prompt``), then the model's
    chat template."""
    template = tokenizer.chat_template
    messages = prepare_tool_messages(template, normalize_messages(messages), template_kwargs.get("tools"))
    if not renders_tools(template):
        template_kwargs = {k: v for k, v in template_kwargs.items() if k != "tools"}
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, **template_kwargs
    )


def chat_prompt_ids(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> list[int]:
    """``/v1/chat/completions``: the rendered chat prompt, encoded without extra special tokens (the template
    already writes them)."""
    return encode_chat_prompt(
        tokenizer, render_chat_prompt(tokenizer, messages, add_generation_prompt, **template_kwargs)
    )


def encode_chat_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """The ids of a rendered chat prompt: no extra special tokens (the template already wrote them). Apart
    from :func:`chat_prompt_ids` so the server can check the text's length before paying for encoding."""
    return tokenizer.encode(text, add_special_tokens=False)
