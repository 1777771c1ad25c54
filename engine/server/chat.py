"""``POST /v1/chat/completions``: the model's chat template, ``n``, ``logprobs``/``top_logprobs``, streaming,
structured outputs and tools (docs/architecture.md#structured-outputs).

A stream's first chunk carries the first token: the assistant ``role`` is coalesced with the first
content delta of each choice instead of being sent ahead of it (so its arrival is the TTFT a client and
a router measure). With tools (``tool_choice`` other than ``none``) each choice's text goes through a
``ToolCallStream``: calls leave as ``tool_calls`` deltas (one per event, as OpenAI sends them) and the
choice ends with ``finish_reason: "tool_calls"``; ``required`` and a named function are enforced by a
grammar (``tool_calls``), which cannot be combined with another structured-output constraint.
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
from kvpilot.engine.server.protocol import STRUCTURED_TEXT, ChatCompletionRequest, check_text
from kvpilot.engine.server.responses import respond, usage
from kvpilot.engine.server.sampling_mapping import check_against_engine, check_prompt_length, sampling_params
from kvpilot.engine.server.state import request_context, server_state
from kvpilot.engine.server.structured_fields import compile_structure, requested_structure
from kvpilot.engine.server.tool_calls import call_grammar, function_schemas, tool_choice
from kvpilot.engine.server.tool_parsers import ToolCallDelta, ToolCallStream, parse_tool_calls
from kvpilot.engine.tool_prompt import tool_call_format

router = APIRouter()


class ChatFormat:
    def __init__(
        self, gen: Generation, model: str, body: ChatCompletionRequest, tool_format: str | None = None
    ) -> None:
        """``tool_format``: the tool-call format to parse each choice's text in (None: plain text)."""
        self._gen, self._model = gen, model
        self._top_n = body.top_logprobs or 0
        self._created = int(time.time())
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self._started: set[int] = set()  # choices whose role was sent
        self._tool_format = tool_format
        self._tools: dict[int, ToolCallStream] = {}  # per choice

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

    def _split(self, index: int, text: str, finish_reason: str | None) -> tuple[str, list, str | None]:
        """A choice's new text → (content, tool-call deltas, finish reason)."""
        if self._tool_format is None:
            return text, [], finish_reason
        stream = self._tools.setdefault(index, ToolCallStream(self._tool_format))
        content, calls = stream.push(text)
        if finish_reason is not None:
            more, last = stream.finish()
            content, calls = content + more, calls + last
            if finish_reason == "stop" and stream.called:
                finish_reason = "tool_calls"
        return content, calls, finish_reason

    def chunk_events(self, index: int, chunk: OutputChunk) -> list[dict]:
        events = []
        for d in chunk.samples:
            content, calls, finish_reason = self._split(d.index, d.text, d.finish_reason)
            logprobs = self._logprobs(d.token_ids, d.logprobs)
            if not (content or calls or finish_reason or logprobs or chunk.prompt_logprobs is not None):
                continue  # held back (a possible tool-call tag): it leaves with what follows
            deltas: list[dict] = [{}]
            if d.index not in self._started:
                self._started.add(d.index)
                deltas[0]["role"] = "assistant"
            if content or ("role" in deltas[0] and not calls):
                deltas[0]["content"] = content
            deltas[0].update(_tool_delta(calls[:1]))
            deltas += [_tool_delta([c]) for c in calls[1:]]
            for i, delta in enumerate(deltas):
                last = i == len(deltas) - 1
                choice = {
                    "index": d.index,
                    "delta": delta,
                    "logprobs": logprobs if last else None,
                    "finish_reason": finish_reason if last else None,
                    "stop_reason": d.stop_reason if last else None,
                }
                if chunk.prompt_logprobs is not None and i == 0:
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
            message: dict = {"role": "assistant", "content": "".join(s.text)}
            finish_reason = s.finish_reason
            if self._tool_format is not None:
                parsed = parse_tool_calls(message["content"], self._tool_format)
                message["content"] = parsed.content
                if parsed.tool_calls:
                    message["tool_calls"] = parsed.tool_calls
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            choice = {
                "index": i,
                "message": message,
                "logprobs": self._logprobs(s.token_ids, s.logprobs),
                "finish_reason": finish_reason,
                "stop_reason": s.stop_reason,
            }
            if result.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(result.prompt_logprobs)
            choices.append(choice)
        return {
            **self._envelope("chat.completion", choices),
            "usage": usage(self._gen, self._gen.completion_tokens),
        }


def _tool_delta(calls: list[ToolCallDelta]) -> dict:
    return {"tool_calls": [c.as_json() for c in calls]} if calls else {}


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state, ctx = server_state(request), request_context(request)
    info = state.info
    state.check_model(body.model)
    for name in ("messages", "stop", "bad_words", "chat_template_kwargs", "tools", "user", *STRUCTURED_TEXT):
        check_text(getattr(body, name), name)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
    functions = function_schemas(body.tools)
    choice = tool_choice(body.tool_choice, functions)
    tool_format = tool_call_format(info.tokenizer.chat_template)
    structure = requested_structure(body)
    calls = call_grammar(choice, functions, tool_format, body.parallel_tool_calls is not False)
    if calls is not None:
        if structure is not None:
            raise bad_request(
                f"tool_choice {choice.mode!r} generates under its own grammar: it does not combine with "
                f"{structure[1]}",
                structure[1],
            )
        structure = (calls, "tools")
    explicit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(
        body, max_tokens=explicit, logprobs=logprobs, structured=structure[0] if structure else None
    )
    if structure is not None:
        await compile_structure(info.grammars, *structure, state.metrics.structured)
    prompt = await run_in_threadpool(
        chat_prompt, info.tokenizer, body, functools.partial(check_prompt_length, info=info)
    )
    check_against_engine(prompt.token_ids, params, info, explicit_max_tokens=explicit is not None)
    gen = Generation(
        state, ctx, "chat", f"chatcmpl-{uuid.uuid4().hex}", [prompt], params, body.priority or 0, body.user
    )
    fmt = ChatFormat(gen, state.model_name, body, tool_format if choice.parses else None)
    return await respond(request, state, gen, fmt, stream=bool(body.stream))
