"""One HTTP request's engine requests (one per prompt), seen from its handler: hand them to the engine
loop, take their chunks in arrival order, time every emit, and account each request exactly once when it
ends — completed, failed, or cancelled because the client went away (``close``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from functools import partial

from kvpilot.engine.outputs import Logprob
from kvpilot.engine.sampling.params import SamplingParams
from kvpilot.engine.server.output_deltas import OutputChunk
from kvpilot.engine.server.prompts import PromptInput
from kvpilot.engine.server.request_stream import RequestStream
from kvpilot.engine.server.request_timeline import COMPLETED, RequestTimeline, slo_attained
from kvpilot.engine.server.serving_request import Failure, ServingRequest
from kvpilot.engine.server.state import RequestContext, ServerState
from kvpilot.engine.server.tracing import RequestSpan


@dataclass
class SampleResult:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class PromptResult:
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    samples: dict[int, SampleResult] = field(default_factory=dict)
    prompt_logprobs: list | None = None

    def add(self, chunk: OutputChunk) -> None:
        self.num_cached_tokens = chunk.num_cached_tokens
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        for d in chunk.samples:
            s = self.samples.setdefault(d.index, SampleResult())
            s.text.append(d.text)
            s.token_ids.extend(d.token_ids)
            if d.logprobs is not None:
                s.logprobs = (s.logprobs or []) + list(d.logprobs)
            if d.finish_reason is not None:
                s.finish_reason, s.stop_reason = d.finish_reason, d.stop_reason


class Generation:
    def __init__(
        self,
        state: ServerState,
        ctx: RequestContext,
        kind: str,
        request_id: str,
        prompts: list[PromptInput],
        params: SamplingParams,
        priority: int,
        user: str | None,
    ) -> None:
        self._state = state
        self.request_id = request_id
        self.prompts = prompts
        loop = asyncio.get_running_loop()
        cfg = state.config
        self.requests: list[ServingRequest] = []
        self.timelines: list[RequestTimeline] = []
        for i, prompt in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            stream = RequestStream(
                loop,
                cfg.stream_buffer_chunks,
                cfg.stream_resume_depth,
                partial(state.loop.resume, rid),
                cfg.stream_queue_bytes,
            )
            span = RequestSpan(
                state.tracer,
                f"{kind} {state.model_name}",
                ctx.arrival_ns,
                {
                    "gen_ai.operation.name": kind,
                    "gen_ai.request.model": state.model_name,
                    "gen_ai.response.id": rid,
                    "gen_ai.request.max_tokens": params.max_tokens or 0,
                    "gen_ai.request.temperature": params.temperature,
                    "gen_ai.request.top_p": params.top_p,
                    "gen_ai.usage.input_tokens": len(prompt.token_ids),
                    "enduser.id": (user or "") if cfg.trace_user else "",
                    "kvpilot.tenant": ctx.tenant or "",
                },
                ctx.headers,
            )
            self.requests.append(
                ServingRequest(rid, prompt.token_ids, params, ctx.tenant, priority, ctx.arrival, stream, span)
            )
            self.timelines.append(RequestTimeline(ctx.arrival))
        self._open = set(range(len(prompts)))
        self._reasons: list[str | None] = [None] * len(prompts)
        self._gets: dict[int, asyncio.Future] = {}
        self.completion_tokens = 0
        self.cached_tokens = [0] * len(prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    @property
    def degraded(self) -> bool:
        return any(r.degraded for r in self.requests)

    def start(self) -> None:
        self._state.loop.submit(self.requests)

    async def next(self) -> tuple[int, OutputChunk] | None:
        """The next chunk of any of its requests, None once all have finished. Raises the ``APIError`` of
        a request that failed (after cancelling the others: the HTTP request fails as a whole)."""
        if not self._open:
            return None
        if len(self.requests) == 1:
            index, item = 0, await self.requests[0].stream.get()
        else:
            index, item = await self._next_of_many()
        now = time.monotonic()
        if isinstance(item, Failure):
            for i in sorted(self._open) if item.whole_batch else [index]:
                self._end(i, item.finish_reason, now, error=item.error.message)
            self.close()
            raise item.error
        self._record(index, item, now)
        return index, item

    async def _next_of_many(self) -> tuple[int, object]:
        # One outstanding get() per open stream: at most one chunk per stream is taken ahead of the
        # client, so backpressure still holds.
        for i in self._open:
            if i not in self._gets:
                self._gets[i] = asyncio.ensure_future(self.requests[i].stream.get())
        done, _ = await asyncio.wait(self._gets.values(), return_when=asyncio.FIRST_COMPLETED)
        finished = next(iter(done))
        index = next(i for i, task in self._gets.items() if task is finished)
        del self._gets[index]
        return index, finished.result()

    def _record(self, index: int, chunk: OutputChunk, now: float) -> None:
        timeline, req, m = self.timelines[index], self.requests[index], self._state.metrics
        self.cached_tokens[index] = chunk.num_cached_tokens
        for d in chunk.samples:
            first = timeline.first_emit is None
            for gap in timeline.emit(d.index, len(d.token_ids), now):
                m.itl.observe(gap)
            if first and timeline.first_emit is not None:
                m.ttft.observe(now - timeline.arrival)
                req.span.event("first_token", {"ttft_s": now - timeline.arrival})
            self.completion_tokens += len(d.token_ids)
            if d.finish_reason is not None and (d.index == 0 or self._reasons[index] is None):
                self._reasons[index] = d.finish_reason
        if chunk.finished:
            self._end(index, self._reasons[index] or "stop", now)

    def _end(self, index: int, reason: str | None, now: float, error: str | None = None) -> None:
        """Account request ``index`` once: finished counter, TPOT/E2E, SLO, span. ``reason`` None = it was
        turned away before it was queued (a rejection, counted by the error response instead)."""
        if index not in self._open:
            return
        self._open.discard(index)
        task = self._gets.pop(index, None)
        if task is not None:
            task.cancel()
        req, m, cfg = self.requests[index], self._state.metrics, self._state.config
        lat = self.timelines[index].latencies(now)
        if reason is not None:
            m.finished(reason)
            for tpot in lat.tpots:
                m.tpot.observe(tpot)
            if reason in COMPLETED:
                m.e2e.observe(lat.e2e)
            if slo_attained(lat, reason, cfg.slo_ttft_s, cfg.slo_tpot_s):
                m.slo_attained.inc()
                m.slo_attained_tokens.inc(lat.num_output_tokens)
        req.span.set_attributes(
            {
                "gen_ai.usage.output_tokens": lat.num_output_tokens,
                "gen_ai.response.finish_reasons": (reason or "rejected",),
                "kvpilot.e2e_s": lat.e2e,
                "kvpilot.ttft_s": lat.ttft,
                "kvpilot.cached_tokens": self.cached_tokens[index],
            }
        )
        req.span.event("finished", {"finish_reason": reason or "rejected"})
        if error is None and reason not in COMPLETED:
            error = f"finished: {reason}"
        req.span.end(error)

    def close(self) -> None:
        """Cancel whatever has not finished (the client left, or another prompt failed): the engine loop
        drops it and reclaims its blocks. Idempotent; a no-op once everything finished."""
        now = time.monotonic()
        cancel = []
        for i in sorted(self._open):
            failure = self._buffered_failure(i)
            if failure is not None:  # it had already ended on its own: account it as it ended
                self._end(i, failure.finish_reason, now, error=failure.error.message)
            else:
                cancel.append(i)
        if not cancel:
            return
        self._state.loop.abort([self.requests[i].request_id for i in cancel])
        for i in cancel:
            self._end(i, "abort", now, error="cancelled: the client disconnected or the request failed")

    def _buffered_failure(self, index: int) -> Failure | None:
        task = self._gets.get(index)
        if task is not None and task.done() and not task.cancelled() and isinstance(task.result(), Failure):
            return task.result()
        stream = self.requests[index].stream
        while (item := stream.take_nowait()) is not None:
            if isinstance(item, Failure):
                return item
        return None
