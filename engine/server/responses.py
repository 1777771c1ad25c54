"""Turning a ``Generation`` into an HTTP response, streaming (SSE) or not, with the rules both endpoints
share:

- Nothing is sent before the first token is ready: the response starts with the first chunk, so a request
  that fails before it (queue full or deadline, draining, engine failure) still gets a proper status code —
  and a router can retry 502/503/504 elsewhere, since no byte was sent.
- A client that disconnects at any point cancels its engine requests (blocks reclaimed at once).
- A failure after streaming started is sent as an ``{"error": ...}`` event, then ``[DONE]`` (as vLLM does).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvpilot.engine.server.disconnect import ClientDisconnected, SSEResponse, until_disconnected
from kvpilot.engine.server.errors import APIError
from kvpilot.engine.server.generation import Generation, PromptResult
from kvpilot.engine.server.output_deltas import OutputChunk
from kvpilot.engine.server.state import ServerState

DONE = b"data: [DONE]\n\n"
CLIENT_CLOSED = 499  # nginx's code for "client closed the request": only ever seen in logs
DEGRADED_HEADER = "x-kvpilot-degraded"


def sse(data: dict) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class ResponseFormat(Protocol):
    include_usage: bool

    def chunk_events(self, index: int, chunk: OutputChunk) -> list[dict]: ...

    def usage_event(self) -> dict: ...

    def full_response(self, results: list[PromptResult]) -> dict: ...


def usage(gen: Generation, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": gen.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(gen.cached_tokens)},
    }


async def respond(
    request: Request, state: ServerState, gen: Generation, fmt: ResponseFormat, stream: bool
) -> Response:
    gen.start()
    try:
        first = await until_disconnected(request, gen.next())
        if stream:
            return SSEResponse(_events(state, gen, fmt, first))
        results = await until_disconnected(request, _collect(gen, first))
    except ClientDisconnected:
        gen.close()
        return Response(status_code=CLIENT_CLOSED)
    except BaseException:
        gen.close()
        raise
    headers = {DEGRADED_HEADER: "best_of"} if gen.degraded else None
    return JSONResponse(fmt.full_response(results), headers=headers)


async def _collect(gen: Generation, first: tuple[int, OutputChunk] | None) -> list[PromptResult]:
    results = [PromptResult(len(p.token_ids)) for p in gen.prompts]
    item = first
    while item is not None:
        results[item[0]].add(item[1])
        item = await gen.next()
    return results


async def _events(
    state: ServerState, gen: Generation, fmt: ResponseFormat, first: tuple[int, OutputChunk] | None
) -> AsyncIterator[bytes]:
    try:
        item = first
        while item is not None:
            for event in fmt.chunk_events(*item):
                yield sse(event)
            item = await gen.next()
        if fmt.include_usage:
            yield sse(fmt.usage_event())
        yield DONE
    except APIError as err:
        state.metrics.rejected(err.code)
        yield sse(err.body())
        yield DONE
    finally:
        gen.close()
