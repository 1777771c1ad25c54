"""Open-loop arrival schedules: when each request is *supposed* to arrive, independent of the server.

Inter-arrival times are gamma distributed with shape ``burstiness`` and mean ``1/rate`` (the convention of
vLLM's benchmark_serving): shape 1 is the exponential, i.e. a Poisson process; the coefficient of
variation of the gaps is ``1/sqrt(burstiness)``, so shape < 1 gives bursts and shape > 1 evens the gaps out.
The schedule is fixed before the run starts, which is what makes the latency accounting free of
coordinated omission: a request's latency is measured from its entry here, not from when it was sent.
"""

from __future__ import annotations

import math

import numpy as np

# How many gaps to draw per batch when only a duration bounds the schedule.
_DURATION_BATCH = 1024


def arrival_offsets(
    rate: float,
    burstiness: float,
    rng: np.random.Generator,
    count: int | None = None,
    duration_s: float | None = None,
) -> np.ndarray:
    """Scheduled arrival times in seconds from the start of a load point; the first is at 0.

    ``rate`` is the mean arrival rate in requests/s (``math.inf``: everything at 0). The schedule ends
    after ``count`` arrivals or before ``duration_s``, whichever comes first; at least one bound is needed.
    """
    if count is None and duration_s is None:
        raise ValueError("arrival_offsets needs a count or a duration")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 or inf (got {rate})")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be positive and finite (got {burstiness})")
    if math.isinf(rate):
        if count is None:
            raise ValueError("an infinite rate needs a count")
        return np.zeros(count)

    scale = 1.0 / (rate * burstiness)  # gamma mean = shape * scale = 1 / rate
    if count is not None:
        gaps = rng.gamma(shape=burstiness, scale=scale, size=max(count - 1, 0))
        offsets = np.concatenate(([0.0], np.cumsum(gaps)))
        return offsets if duration_s is None else offsets[offsets < duration_s]

    # Duration only: draw gaps in batches until the schedule passes the end.
    assert duration_s is not None  # checked on entry: a count or a duration
    pieces = [np.zeros(1)]
    last = 0.0
    while last < duration_s:
        batch = last + np.cumsum(rng.gamma(shape=burstiness, scale=scale, size=_DURATION_BATCH))
        pieces.append(batch)
        last = float(batch[-1])
    offsets = np.concatenate(pieces)
    return offsets[offsets < duration_s]


def coefficient_of_variation(offsets: np.ndarray) -> float:
    """Standard deviation over mean of the gaps between consecutive arrivals (1 for a Poisson process)."""
    gaps = np.diff(offsets)
    return float(np.std(gaps) / np.mean(gaps))
