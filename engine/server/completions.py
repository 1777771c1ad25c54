"""``POST /v1/completions``: OpenAI's legacy completions (several prompts, ``n``, ``echo``, ``logprobs``),
streaming or not, structured outputs as on chat (``structured_fields``). Choice ``index`` = prompt index ×
n + sample index, as OpenAI and vLLM number them."""

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
from kvpilot.engine.server.logprobs_format import completion_logprobs, prompt_logprobs_json
from kvpilot.engine.server.output_deltas import OutputChunk
from kvpilot.engine.server.prompts import check_prompt_count, completion_prompts, holds_token_ids
from kvpilot.engine.server.protocol import STRUCTURED_TEXT, CompletionRequest, check_text
from kvpilot.engine.server.responses import respond, usage
from kvpilot.engine.server.sampling_mapping import check_against_engine, check_prompt_length, sampling_params
from kvpilot.engine.server.state import request_context, server_state
from kvpilot.engine.server.structured_fields import compile_structure, requested_structure
from kvpilot.engine.tokenizer import Tokenizer

router = APIRouter()
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint


class CompletionFormat:
    def __init__(self, gen: Generation, model: str, body: CompletionRequest, tokenizer: Tokenizer) -> None:
        self._gen, self._model, self._body, self._tokenizer = gen, model, body, tokenizer
        self._n = gen.requests[0].params.n
        self._created = int(time.time())
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self._offsets: dict[int, int] = {}  # choice → text offset of its next token
        self._echoed: set[int] = set()

    def _echo(self, prompt_index: int, choice: int) -> str:
        if not self._body.echo or choice in self._echoed:
            return ""
        self._echoed.add(choice)
        prompt = self._gen.prompts[prompt_index]
        return prompt.text if prompt.text is not None else self._tokenizer.decode(prompt.token_ids)

    def _choice(
        self,
        prompt_index: int,
        index: int,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[dict[int, Logprob]] | None,
        finish_reason: str | None,
        stop_reason: str | int | None,
    ) -> dict:
        choice = prompt_index * self._n + index
        text = self._echo(prompt_index, choice) + text
        lp = None
        if logprobs is not None:
            lp, self._offsets[choice] = completion_logprobs(token_ids, logprobs, self._offsets.get(choice, 0))
        return {
            "index": choice,
            "text": text,
            "logprobs": lp,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def _envelope(self, choices: list[dict]) -> dict:
        return {
            "id": self._gen.request_id,
            "object": "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": choices,
        }

    def chunk_events(self, index: int, chunk: OutputChunk) -> list[dict]:
        events = []
        for d in chunk.samples:
            choice = self._choice(
                index, d.index, d.text, d.token_ids, d.logprobs, d.finish_reason, d.stop_reason
            )
            if chunk.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(chunk.prompt_logprobs)
            event = self._envelope([choice])
            if self.include_usage:
                event["usage"] = None
            events.append(event)
        return events

    def usage_event(self) -> dict:
        return {**self._envelope([]), "usage": usage(self._gen, self._gen.completion_tokens)}

    def full_response(self, results: list[PromptResult]) -> dict:
        choices = []
        for p, result in enumerate(results):
            for i in sorted(result.samples):
                s = result.samples[i]
                choice = self._choice(
                    p, i, "".join(s.text), s.token_ids, s.logprobs, s.finish_reason, s.stop_reason
                )
                if result.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(result.prompt_logprobs)
                choices.append(choice)
        choices.sort(key=lambda c: c["index"])
        return {**self._envelope(choices), "usage": usage(self._gen, self._gen.completion_tokens)}


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state, ctx = server_state(request), request_context(request)
    info = state.info
    state.check_model(body.model)
    check_prompt_count(body.prompt, state.config.max_queue_len)
    if not holds_token_ids(body.prompt):  # ids are ints by the body's type: nothing to check, per id
        check_text(body.prompt, "prompt")
    for name in ("stop", "bad_words", "suffix", "user", *STRUCTURED_TEXT):
        check_text(getattr(body, name), name)
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if body.echo and body.logprobs is not None:
        raise bad_request("echo together with logprobs is not supported", "echo")
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    structure = requested_structure(body)
    params = sampling_params(
        body, max_tokens=max_tokens, logprobs=body.logprobs, structured=structure[0] if structure else None
    )
    if structure is not None:
        await compile_structure(info.grammars, *structure, state.metrics.structured)
    prompts = await run_in_threadpool(
        completion_prompts, info.tokenizer, body.prompt, functools.partial(check_prompt_length, info=info)
    )
    for prompt in prompts:
        check_against_engine(prompt.token_ids, params, info, explicit_max_tokens=body.max_tokens is not None)
    gen = Generation(
        state,
        ctx,
        "text_completion",
        f"cmpl-{uuid.uuid4().hex}",
        prompts,
        params,
        body.priority or 0,
        body.user,
    )
    return await respond(
        request,
        state,
        gen,
        CompletionFormat(gen, state.model_name, body, info.tokenizer),
        stream=bool(body.stream),
    )
