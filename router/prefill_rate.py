"""A replica's prefill rate (prompt tokens per second): the divisor that turns token work into seconds.

Sources, best first:
1. the engine's own measurement (``prefill_tokens_per_second`` in ``/load``, an EMA over its recent
   steps): it times prefill directly, without network or queueing noise;
2. what this router observed: for each request it sent, the prefill work it estimated ahead of and for that
   request (queued + uncached tokens) over the time to its first byte, smoothed by an EMA. Only requests
   with enough work count, since a short prefill's first byte is mostly fixed latency;
3. a prior, before anyone has measured.
The picker costs every replica at the fleet's median of these (see ``picker``), or, when asked to, at the
replica's own.
"""

from __future__ import annotations


class PrefillRateEstimator:
    def __init__(self, smoothing: float = 0.2, min_sample_tokens: int = 256) -> None:
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self._smoothing = smoothing
        self._min_sample_tokens = min_sample_tokens
        self.engine_rate = 0.0
        self.observed_rate: float | None = None

    def report_engine(self, tokens_per_second: float) -> None:
        """The engine's latest figure (0 = not measured yet, which keeps the previous one)."""
        if tokens_per_second > 0:
            self.engine_rate = tokens_per_second

    def observe(self, work_tokens: int, first_byte_seconds: float) -> None:
        """A request with ``work_tokens`` of prefill ahead and in it got its first byte after that long."""
        if work_tokens < self._min_sample_tokens or first_byte_seconds <= 0:
            return
        sample = work_tokens / first_byte_seconds
        if self.observed_rate is None:
            self.observed_rate = sample
        else:
            self.observed_rate += self._smoothing * (sample - self.observed_rate)

    def reset(self) -> None:
        """The engine restarted (new epoch): its old figures describe another process."""
        self.engine_rate = 0.0
        self.observed_rate = None

    def rate(self) -> float | None:
        """Tokens per second, or None when neither the engine nor this router has measured any."""
        if self.engine_rate > 0:
            return self.engine_rate
        return self.observed_rate
