"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions``: OpenAI's fields plus vLLM's extra
sampling parameters at the top level of the body, validated strictly at the boundary (a string is not a
number, a boolean is not an integer, NaN/Infinity are refused). Unknown fields are ignored, as vLLM does.
Structured outputs (``response_format``, ``structured_outputs``, ``guided_*``) are read by
``structured_fields``, tools by ``tool_calls``.
Ranges that depend on the engine (context length, vocabulary, max_logprobs) are checked after
tokenization; ranges of the sampling parameters by ``SamplingParams`` itself, each naming its field.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from kvpilot.engine.server.errors import bad_request

Int64Seed = Annotated[int, Field(ge=-(1 << 63), le=(1 << 64) - 1)]
MAX_STOP_STRINGS = 64
#: the structured-output fields, for ``check_text``
STRUCTURED_TEXT = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
MAX_SAMPLES = 128


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    #: send a last chunk with ``usage`` (and ``"usage": null`` on every other chunk)
    include_usage: bool | None = None


class SamplingFields(BaseModel):
    """Fields both endpoints share (vLLM's names for the extras)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    model: str | None = Field(None, description="must equal the served model name (404 otherwise)")
    n: int | None = Field(None, ge=1, le=MAX_SAMPLES)
    best_of: int | None = Field(None, ge=1, le=MAX_SAMPLES)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float | None = None
    seed: Int64Seed | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    no_repeat_ngram_size: int | None = None
    use_beam_search: bool | None = None
    prompt_logprobs: int | None = Field(None, ge=0)
    #: scheduling priority (lower runs first), as vLLM's ``priority``
    priority: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    #: end-user id (recorded on the request's trace span)
    user: str | None = None
    #: OpenAI's ``{"type": "text" | "json_object" | "json_schema", ...}``
    response_format: dict[str, Any] | None = None
    #: vLLM's ``{"json" | "regex" | "choice" | "grammar" | "json_object": ..., ...}``
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    #: a string, a list of token ids, a list of strings, or a list of token-id lists (several prompts)
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    #: top-N logprobs per generated token (the sampled token is always included)
    logprobs: int | None = Field(None, ge=0)
    suffix: str | None = None


# What the OpenAPI schema documents for a message; the server passes each message to the model's chat
# template as sent (so the router derives the same prompt), and the template decides what it accepts.
_MESSAGE_SCHEMA = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array"}, {"type": "null"}]},
        "tool_calls": {"type": "array", "items": {"type": "object"}},
        "tool_call_id": {"type": "string"},
    },
}


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[
        list[dict[str, Any]], Field(min_length=1, json_schema_extra={"items": _MESSAGE_SCHEMA})
    ]
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


def check_text(value: Any, field: str) -> None:
    """Refuse strings that are not valid Unicode (lone surrogates from JSON escapes): the tokenizer and
    the chat template cannot take them, and they must never reach the engine thread."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request(f"{field} contains invalid Unicode (a lone surrogate)", field) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, field)
            check_text(item, field)
    elif isinstance(value, list):
        for item in value:
            check_text(item, field)
