"""One engine request as the server tracks it between its HTTP handler and the engine loop.

The handler builds it (tokenized, validated) and hands it to the engine loop; from then on the fields
below the marker belong to the engine thread, and the handler only reads the request's stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvpilot.engine.sampling.params import SamplingParams
from kvpilot.engine.server.errors import APIError
from kvpilot.engine.server.output_deltas import DeltaTracker
from kvpilot.engine.server.request_stream import RequestStream
from kvpilot.engine.server.tracing import RequestSpan


@dataclass(frozen=True)
class Failure:
    """The last item of a stream whose request ended without (all of) its output."""

    error: APIError
    #: the finish reason to account the request under; None = it was turned away before it was queued
    #: (counted as a rejection, not as a finished request)
    finish_reason: str | None
    #: every request of the HTTP request's batch was turned away with this same error
    whole_batch: bool = False


@dataclass(eq=False)
class ServingRequest:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    priority: int
    #: monotonic time the HTTP request reached the server: the boundary of TTFT, E2E and the queue deadline
    arrival: float
    stream: RequestStream
    span: RequestSpan
    # ---- engine thread only -----------------------------------------------------------------------
    #: KV blocks the request reserves at admission (after its prefix lookup)
    cost_blocks: int = 0
    #: the scheduler has run it at least once (it left the queue)
    scheduled: bool = False
    #: admitted with fewer parallel samples than asked (best_of shrunk to n, the degrade policy)
    degraded: bool = False
    #: monotonic time the request was paused for a client that does not read (None = not paused)
    paused_since: float | None = None
    deltas: DeltaTracker = field(init=False)

    def __post_init__(self) -> None:
        # the stream is built from what is new each step: outputs that copy the whole completion every
        # step would cost more the longer it gets
        self.params = replace(self.params, output_kind="delta")
        self.deltas = DeltaTracker(self.params.detokenize)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids)

    def fail(self, error: APIError, finish_reason: str | None, whole_batch: bool = False) -> None:
        self.stream.put(Failure(error, finish_reason, whole_batch))
