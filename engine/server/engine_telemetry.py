"""What the engine thread observes after each step: engine-stat deltas → counters (the grammar-mask cost
among them), the step's schedule → span events and each request's ``scheduled`` flag, terminal records →
per-request engine-side times. It also hooks grammar compile times into their histogram.

The first snapshot of the engine's counters is taken after warm-up, so warm-up work never shows up in
steady-state metrics (docs/architecture.md#readiness-and-warm-up). Terminal records are consumed and cleared
here, which keeps the engine's record list from growing for the life of the server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpilot.engine.outputs import TerminalRecord
from kvpilot.engine.server.metrics import ServerMetrics
from kvpilot.engine.server.serving_request import ServingRequest

if TYPE_CHECKING:  # torch: only the engine thread imports the engine
    from kvpilot.engine.engine_core import LLMEngine


class EngineTelemetry:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics) -> None:
        self._engine = engine
        self._metrics = metrics
        self._counters = (
            metrics.prompt_tokens,
            metrics.generation_tokens,
            metrics.prefix_queries,
            metrics.prefix_hits,
            metrics.preemptions,
            metrics.structured.masked_tokens,
            metrics.structured.mask_seconds,
        )
        self._last = self._counts()
        metrics.spec_decode.start(engine.stats)
        engine.terminal_records.clear()
        engine.grammars.on_compiled = metrics.structured.compiled  # called on the compiler's threads

    def _counts(self) -> tuple[float, ...]:
        s, masks = self._engine.stats, self._engine.sampler.grammar_masks
        return (
            s.prompt_tokens,
            s.generation_tokens,
            s.prefix_cache_queries,
            s.prefix_cache_hits,
            s.preemptions,
            masks.rows,
            masks.seconds,
        )

    def after_step(self, active: dict[str, ServingRequest]) -> None:
        counts = self._counts()
        for counter, now, before in zip(self._counters, counts, self._last, strict=True):
            if now > before:
                counter.inc(now - before)
        self._last = counts
        engine = self._engine
        self._metrics.spec_decode.after_step(engine.stats)
        for request_id, computed_before, num_tokens in engine.last_step_scheduled:
            req = active.get(request_id)
            if req is None:
                continue
            if not req.scheduled:
                req.scheduled = True
                req.span.event("admitted", {"cached_tokens": computed_before})
            if computed_before < req.num_prompt_tokens:
                req.span.event("prefill_chunk", {"start": computed_before, "tokens": num_tokens})
        for request_id in dict.fromkeys(engine.last_step_preempted):
            req = active.get(request_id)
            if req is not None:
                req.span.event("preempted")

    def consume_terminal_records(self) -> None:
        records = self._engine.terminal_records
        for record in records:
            self._observe(record)
        records.clear()

    def _observe(self, record: TerminalRecord) -> None:
        t, m = record.timings, self._metrics
        arrival, scheduled, first = t.get("arrival"), t.get("first_scheduled"), t.get("first_token")
        if scheduled is not None and arrival is not None:
            m.queue_time.observe(max(0.0, scheduled - arrival))
        if first is not None and scheduled is not None:
            m.prefill_time.observe(max(0.0, first - scheduled))
        if record.status == "finished":
            finished = t.get("finished")
            if first is not None and finished is not None:
                m.decode_time.observe(max(0.0, finished - first))
            m.prompt_len.observe(record.num_prompt_tokens)
            m.output_len.observe(record.num_committed)
