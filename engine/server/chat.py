"""``POST /v1/chat/completions``: the model's chat template, ``n``, ``logprobs``/``top_logprobs``, streaming.

A stream's first chunk carries the first token: the assistant ``role`` is coalesced with the first
content delta of each choice instead of being sent ahead of it (so its arrival is the TTFT a client and
a router measure). ``tools`` are passed to the template, but the output is plain text: tool calls are not
parsed, so ``tool_choice`` that demands a call, and ``response_format`` other than text, are refused.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Sequence

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from kvpilot.engine.outputs import Logprob
from kvpilot.engine.server.errors import bad_request
from kvpilot.engine.server.generation import Generation, PromptResult
from kvpilot.engine.server.logprobs_format import chat_logprobs, prompt_logprobs_json
from kvpilot.engine.server.output_deltas import OutputChunk
from kvpilot.engine.server.prompts import chat_prompt
from kvpilot.engine.server.protocol import ChatCompletionRequest, check_text
from kvpilot.engine.server.responses import respond, usage
from kvpilot.engine.server.sampling_mapping import check_against_engine, check_prompt_length, sampling_params
from kvpilot.engine.server.state import request_context, server_state

router = APIRouter()


class ChatFormat:
    def __init__(self, gen: Generation, model: str, body: ChatCompletionRequest) -> None:
        self._gen, self._model = gen, model
        self._top_n = body.top_logprobs or 0
        self._created = int(time.time())
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self._started: set[int] = set()  # choices whose role was sent

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {
            "id": self._gen.request_id,
            "object": obj,
            "created": self._created,
            "model": self._model,
            "choices": choices,
        }

    def _logprobs(
        self, token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]] | None
    ) -> dict | None:
        return None if entries is None else chat_logprobs(token_ids, entries, self._top_n)

    def chunk_events(self, index: int, chunk: OutputChunk) -> list[dict]:
        events = []
        for d in chunk.samples:
            delta: dict = {}
            if d.index not in self._started:
                self._started.add(d.index)
                delta["role"] = "assistant"
            if d.text or "role" in delta:
                delta["content"] = d.text
            choice = {
                "index": d.index,
                "delta": delta,
                "logprobs": self._logprobs(d.token_ids, d.logprobs),
                "finish_reason": d.finish_reason,
                "stop_reason": d.stop_reason,
            }
            if chunk.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(chunk.prompt_logprobs)
            event = self._envelope("chat.completion.chunk", [choice])
            if self.include_usage:
                event["usage"] = None
            events.append(event)
        return events

    def usage_event(self) -> dict:
        return {
            **self._envelope("chat.completion.chunk", []),
            "usage": usage(self._gen, self._gen.completion_tokens),
        }

    def full_response(self, results: list[PromptResult]) -> dict:
        (result,) = results
        choices = []
        for i in sorted(result.samples):
            s = result.samples[i]
            choice = {
                "index": i,
                "message": {"role": "assistant", "content": "".join(s.text)},
                "logprobs": self._logprobs(s.token_ids, s.logprobs),
                "finish_reason": s.finish_reason,
                "stop_reason": s.stop_reason,
            }
            if result.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(result.prompt_logprobs)
            choices.append(choice)
        return {
            **self._envelope("chat.completion", choices),
            "usage": usage(self._gen, self._gen.completion_tokens),
        }


def _check_unsupported(body: ChatCompletionRequest) -> None:
    if body.response_format is not None and body.response_format.get("type", "text") != "text":
        raise bad_request("response_format other than {'type': 'text'} is not supported", "response_format")
    if body.tool_choice is not None and body.tool_choice not in ("none", "auto"):
        raise bad_request(
            "tool_choice may only be 'none' or 'auto': tool calls are not parsed", "tool_choice"
        )
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state, ctx = server_state(request), request_context(request)
    info = state.info
    state.check_model(body.model)
    for name in ("messages", "stop", "bad_words", "chat_template_kwargs", "tools", "user"):
        check_text(getattr(body, name), name)
    _check_unsupported(body)
    explicit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens=explicit, logprobs=logprobs)
    prompt = await run_in_threadpool(
        chat_prompt, info.tokenizer, body, functools.partial(check_prompt_length, info=info)
    )
    check_against_engine(prompt.token_ids, params, info, explicit_max_tokens=explicit is not None)
    gen = Generation(
        state, ctx, "chat", f"chatcmpl-{uuid.uuid4().hex}", [prompt], params, body.priority or 0, body.user
    )
    return await respond(
        request, state, gen, ChatFormat(gen, state.model_name, body), stream=bool(body.stream)
    )
