"""One benchmark request as measured, and the per-request metrics derived from its timestamps.

System boundary: all times are client-side, seconds from the start of the load point, read with one
monotonic clock (``time.perf_counter``). A request's *arrival* is its scheduled time (open loop: from the
arrival schedule; closed loop: the moment a client became free), never the moment it was actually sent,
so time a late client spent not sending counts as latency (no coordinated omission). An *emit* is the
arrival at the client of an SSE event that carried output text. Definitions:
- TTFT  = t_first_emit − t_arrival (includes client lateness, connection, queueing, prefill, network)
- ITL_j = t_emit,j − t_emit,j−1 over consecutive emits (an event carrying several tokens is one emit)
- TPOT  = (t_last_emit − t_first_emit) / (N_out − 1), only for N_out >= 2
- E2E   = t_end − t_arrival, where t_end is when ``data: [DONE]`` was read; it therefore exceeds
  TTFT + ΣITL (= t_last_emit − t_arrival exactly) by the tail after the last emit (the usage event and
  [DONE]), which is reported per request as ``tail_s``.
N_out is the server's ``usage.completion_tokens`` when it sent usage, else the number of emits.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from itertools import pairwise

# Error types a request can end with (besides "http_<status>").
ERROR_TIMEOUT = "timeout"  # the request timeout ran out
ERROR_CONNECTION = "connection_error"  # no HTTP response: refused, reset or connect timeout
ERROR_STREAM_BROKEN = "stream_broken"  # the stream stopped before "data: [DONE]"
ERROR_INVALID_RESPONSE = "invalid_response"  # unparsable event, or an error object inside the stream
ERROR_EMPTY_OUTPUT = "empty_output"  # a complete stream without any output text: TTFT is undefined

PHASE_WARMUP = "warmup"
PHASE_MEASURED = "measured"


@dataclass
class RequestRecord:
    index: int  # position in the request stream of its load point
    phase: str  # PHASE_WARMUP (excluded from the statistics) or PHASE_MEASURED
    prompt_words: int  # the workload's prompt length in words (≈ tokens)
    max_tokens: int  # requested output length
    scheduled_s: float  # arrival: when the request was due
    sent_s: float  # when it was actually handed to the HTTP client (>= scheduled_s)
    tenant: str | None = None
    emit_s: list[float] = field(default_factory=list)  # arrival times of events carrying output text
    end_s: float | None = None  # when [DONE] was read, or when the request failed
    usage_prompt_tokens: int | None = None  # from the server's usage, when sent
    usage_output_tokens: int | None = None  # from the server's usage, when sent
    finish_reason: str | None = None
    error_type: str | None = None  # None when the request succeeded
    error_detail: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_type is None

    @property
    def output_tokens(self) -> int:
        return self.usage_output_tokens if self.usage_output_tokens is not None else len(self.emit_s)

    @property
    def output_token_source(self) -> str:
        return "usage" if self.usage_output_tokens is not None else "chunks"

    @property
    def prompt_tokens(self) -> int:
        return self.usage_prompt_tokens if self.usage_prompt_tokens is not None else self.prompt_words

    @property
    def prompt_token_source(self) -> str:
        return "usage" if self.usage_prompt_tokens is not None else "word_estimate"

    @property
    def send_lag_s(self) -> float:
        """How far behind schedule the client was when it sent this request."""
        return self.sent_s - self.scheduled_s

    @property
    def ttft_s(self) -> float | None:
        if not self.ok or not self.emit_s:
            return None
        return self.emit_s[0] - self.scheduled_s

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or not self.emit_s or self.output_tokens < 2:
            return None
        return (self.emit_s[-1] - self.emit_s[0]) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        if not self.ok:
            return []
        return [later - earlier for earlier, later in pairwise(self.emit_s)]

    @property
    def e2e_s(self) -> float | None:
        if not self.ok or self.end_s is None:
            return None
        return self.end_s - self.scheduled_s

    @property
    def tail_s(self) -> float | None:
        """Time from the last emit to the end of the stream (part of E2E, not of TTFT + ΣITL)."""
        if not self.ok or self.end_s is None or not self.emit_s:
            return None
        return self.end_s - self.emit_s[-1]

    def to_dict(self) -> dict:
        """Raw fields plus the derived metrics, for the JSON report."""
        raw = asdict(self)
        raw["emit_s"] = [round(t, 6) for t in self.emit_s]
        raw.update(
            ok=self.ok,
            output_tokens=self.output_tokens,
            output_token_source=self.output_token_source,
            prompt_tokens=self.prompt_tokens,
            prompt_token_source=self.prompt_token_source,
            send_lag_s=self.send_lag_s,
            ttft_s=self.ttft_s,
            tpot_s=self.tpot_s,
            e2e_s=self.e2e_s,
            tail_s=self.tail_s,
        )
        return raw
