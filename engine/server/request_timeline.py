"""One request's emit times and the latency definitions (docs/architecture.md#latency-definitions), with
arrival at the server as the boundary and the HTTP handler taking a chunk from its stream as the emit:

    TTFT = t_first_emit − t_arrival          ITL_j = t_emit,j − t_emit,j−1 (per sample, j ≥ 2)
    TPOT = (t_last_emit − t_first_emit) / (N_out − 1)   for N_out ≥ 2 (per sample)
    E2E  = t_end − t_arrival                 (t_end: the handler took the request's final chunk)

A chunk carrying k tokens emits all k at once (k−1 gaps of 0), so TTFT + Σ ITL = t_last_emit − t_arrival
exactly, and E2E exceeds it only by what follows the last token (a final chunk without new text).
For a non-streaming response the handler takes chunks at the same moments but writes them at the end:
its TTFT/ITL say when tokens were ready at the HTTP layer, its E2E when the response was complete.

SLO attainment: a request attains when it completed (finish reason stop or length) and met every
configured objective: TTFT ≤ slo_ttft, and every sample's TPOT ≤ slo_tpot (a sample of one token has no
TPOT). Aborted, timed-out and failed requests are misses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

COMPLETED = ("stop", "length")


@dataclass
class SampleEmits:
    first: float | None = None
    last: float | None = None
    num_tokens: int = 0

    def emit(self, num_tokens: int, now: float) -> list[float]:
        """``num_tokens`` tokens of this sample reached the client at ``now`` (one chunk); returns their
        ITL values (none for the sample's first token, 0 for the chunk's other tokens)."""
        if num_tokens <= 0:
            return []
        gaps = [] if self.last is None else [now - self.last]
        if self.last is None:
            self.first = now
        gaps.extend([0.0] * (num_tokens - 1))
        self.num_tokens += num_tokens
        self.last = now
        return gaps

    @property
    def tpot(self) -> float | None:
        if self.num_tokens < 2 or self.first is None or self.last is None:
            return None
        return (self.last - self.first) / (self.num_tokens - 1)


@dataclass(frozen=True)
class Latencies:
    ttft: float | None
    tpots: list[float]
    e2e: float
    num_output_tokens: int


@dataclass
class RequestTimeline:
    arrival: float
    first_emit: float | None = None
    samples: dict[int, SampleEmits] = field(default_factory=dict)

    def emit(self, sample_index: int, num_tokens: int, now: float) -> list[float]:
        """Record that ``num_tokens`` of a sample were emitted at ``now``; returns their ITL values."""
        if num_tokens <= 0:
            return []
        if self.first_emit is None:
            self.first_emit = now
        return self.samples.setdefault(sample_index, SampleEmits()).emit(num_tokens, now)

    @property
    def last_emit(self) -> float | None:
        return max((s.last for s in self.samples.values() if s.last is not None), default=None)

    def latencies(self, end: float) -> Latencies:
        tpots = [t for s in self.samples.values() if (t := s.tpot) is not None]
        return Latencies(
            ttft=None if self.first_emit is None else self.first_emit - self.arrival,
            tpots=tpots,
            e2e=end - self.arrival,
            num_output_tokens=sum(s.num_tokens for s in self.samples.values()),
        )


def slo_attained(
    lat: Latencies, finish_reason: str, slo_ttft_s: float | None, slo_tpot_s: float | None
) -> bool:
    if finish_reason not in COMPLETED:
        return False
    if slo_ttft_s is not None and (lat.ttft is None or lat.ttft > slo_ttft_s):
        return False
    return slo_tpot_s is None or all(t <= slo_tpot_s for t in lat.tpots)
