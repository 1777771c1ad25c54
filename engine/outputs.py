"""Result objects of the offline API (vLLM-shaped) and the terminal record every request leaves."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One entry of a token's logprob report."""

    logprob: float
    #: 1-based rank of the token in its distribution
    rank: int
    #: the token's text (filled by the output processor)
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    #: per generated token: {token_id: Logprob} of the top-N and the sampled token, when requested
    logprobs: list[dict[int, Logprob]] | None = None
    #: "stop", "length", "abort", "timeout", "error" — None while running
    finish_reason: str | None = None
    #: the stop string or stop token id that ended the sample
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Monotonic timestamps; TTFT/ITL/TPOT as in docs/architecture.md#latency-definitions (arrival is the
    boundary)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    #: prompt tokens served from the prefix cache
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    #: per prompt token: {token_id: Logprob} (the prompt token and the top-N); None for the first token
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class TerminalRecord:
    """Exactly one per request, written by the reclaim routine whatever the terminal state."""

    request_id: str
    status: str
    finish_reason: str
    #: tokens the model produced / tokens sent to the client / tokens kept in the final output
    num_generated: int
    num_emitted: int
    num_committed: int
    num_prompt_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    timings: dict[str, float | None] = field(default_factory=dict)
    #: speculative decoding: draft tokens scored for the request's sequences, and how many were accepted
    #: (each accepted draft is also one of ``num_generated``)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
