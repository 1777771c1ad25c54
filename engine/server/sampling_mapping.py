"""OpenAI/vLLM request fields → ``SamplingParams``, and the checks that need the loaded engine's limits.
Every failure is a 400 naming the offending field."""

from __future__ import annotations

from kvpilot.engine.prompt_bound import min_tokens
from kvpilot.engine.request_validation import RequestError, validate_params, validate_prompt
from kvpilot.engine.sampling.params import SamplingParams, SamplingParamsError
from kvpilot.engine.server.engine_info import EngineInfo
from kvpilot.engine.server.errors import bad_request
from kvpilot.engine.server.protocol import SamplingFields
from kvpilot.engine.structured.params import StructuredOutputsParams

# Body fields that map one-to-one onto SamplingParams (same name, same meaning).
_SAME_NAME = (
    "n",
    "best_of",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "typical_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "length_penalty",
    "seed",
    "stop_token_ids",
    "bad_words",
    "include_stop_str_in_output",
    "ignore_eos",
    "skip_special_tokens",
    "min_tokens",
    "allowed_token_ids",
    "no_repeat_ngram_size",
    "use_beam_search",
    "prompt_logprobs",
)


def sampling_params(
    body: SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    structured: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """``structured``: the request's constraint (``structured_fields.requested_structure``)."""
    kwargs: dict = {name: getattr(body, name) for name in _SAME_NAME if getattr(body, name) is not None}
    kwargs["structured_outputs"] = structured
    if body.stop is not None:
        kwargs["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop)
    if body.logit_bias:
        try:
            kwargs["logit_bias"] = {int(token): bias for token, bias in body.logit_bias.items()}
        except ValueError:
            raise bad_request(
                "logit_bias keys must be token ids (integers as strings)", "logit_bias"
            ) from None
    kwargs["max_tokens"] = max_tokens
    kwargs["logprobs"] = logprobs
    try:
        params = SamplingParams(**kwargs)
    except SamplingParamsError as err:
        raise bad_request(str(err), str(err).split(" ", 1)[0]) from None
    if body.stream and (params.use_beam_search or params.num_samples > params.n):
        raise bad_request(
            "stream=true is not supported with best_of > n or use_beam_search: those pick "
            "their outputs only at the end",
            "stream",
        )
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    return params


def check_prompt_length(text: str, info: EngineInfo) -> None:
    """Refuse a prompt text whose length alone proves it longer than the context, before tokenizing it, with
    the error the token count would give."""
    per_token = info.max_chars_per_token
    if per_token is None:
        return
    at_least = min_tokens(len(text), per_token)
    if at_least >= info.max_model_len:
        raise bad_request(
            f"prompt has at least {at_least} tokens ({len(text)} characters, at most {per_token} "
            f"per token); the context limit is {info.max_model_len} (prompt + at least one "
            "generated token)",
            "prompt",
            code="context_length_exceeded",
        )


def check_against_engine(
    token_ids: list[int], params: SamplingParams, info: EngineInfo, explicit_max_tokens: bool
) -> None:
    """Context length, vocabulary and logprob limits of the loaded engine (the engine's own checks, run
    here so a bad request never reaches the engine thread)."""
    try:
        validate_prompt(
            token_ids,
            info.vocab_size,
            info.max_model_len,
            info.max_num_batched_tokens,
            info.enable_chunked_prefill,
        )
        validate_params(params, info.vocab_size, info.max_logprobs, info.max_num_seqs)
    except RequestError as err:
        message = str(err)
        code = "context_length_exceeded" if "context limit" in message else "invalid_request"
        raise bad_request(message, err.param, code=code) from None
    if (
        explicit_max_tokens
        and params.max_tokens is not None
        and len(token_ids) + params.max_tokens > info.max_model_len
    ):
        raise bad_request(
            f"this model's maximum context length is {info.max_model_len} tokens, but the "
            f"request asks for {len(token_ids)} prompt tokens + {params.max_tokens} output "
            "tokens",
            "max_tokens",
            code="context_length_exceeded",
        )
