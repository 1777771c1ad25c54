"""Prompt → token ids exactly as the engine server does it; the router imports the same functions so its
block hashes match the engine's (no torch here)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpilot.engine.tokenizer import Tokenizer


def completion_prompt_ids(tokenizer: Tokenizer, prompt: str | Sequence[int]) -> list[int]:
    """``/v1/completions``: a string is encoded with the tokenizer's special tokens; ids pass through."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=True)
    return [int(t) for t in prompt]


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> list[int]:
    """``/v1/chat/completions``: the model's chat template, then encoding without extra special tokens
    (the template already writes them)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)
