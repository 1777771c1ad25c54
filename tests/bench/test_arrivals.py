"""Arrival schedules: rate, burstiness (CV of the gaps), determinism, bounds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvpilot.bench.arrivals import arrival_offsets, coefficient_of_variation


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_poisson_schedule_has_the_requested_mean_rate_and_unit_cv():
    offsets = arrival_offsets(10.0, 1.0, _rng(), count=20001)
    assert offsets[0] == 0.0 and np.all(np.diff(offsets) >= 0)
    assert (len(offsets) - 1) / offsets[-1] == pytest.approx(10.0, rel=0.03)
    assert coefficient_of_variation(offsets) == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize(("burstiness", "expected_cv"), [(0.25, 2.0), (4.0, 0.5)])
def test_burstiness_sets_the_cv_of_gaps_without_changing_the_rate(burstiness, expected_cv):
    offsets = arrival_offsets(10.0, burstiness, _rng(), count=20001)
    assert (len(offsets) - 1) / offsets[-1] == pytest.approx(10.0, rel=0.05)
    assert coefficient_of_variation(offsets) == pytest.approx(expected_cv, rel=0.08)


def test_lower_burstiness_is_burstier():
    cvs = [coefficient_of_variation(arrival_offsets(5.0, b, _rng(), count=5001)) for b in (0.5, 1.0, 2.0)]
    assert cvs[0] > cvs[1] > cvs[2]


def test_same_seed_same_schedule_other_seed_other_schedule():
    first = arrival_offsets(4.0, 1.0, _rng(7), count=50)
    assert np.array_equal(first, arrival_offsets(4.0, 1.0, _rng(7), count=50))
    assert not np.array_equal(first, arrival_offsets(4.0, 1.0, _rng(8), count=50))
    # The same seed at another rate gives the same pattern, rescaled.
    assert np.allclose(arrival_offsets(8.0, 1.0, _rng(7), count=50), first / 2, rtol=1e-12, atol=0)


def test_infinite_rate_sends_everything_at_once():
    assert np.array_equal(arrival_offsets(math.inf, 1.0, _rng(), count=5), np.zeros(5))
    with pytest.raises(ValueError, match="needs a count"):
        arrival_offsets(math.inf, 1.0, _rng(), duration_s=1.0)


def test_duration_bounds_the_schedule():
    offsets = arrival_offsets(50.0, 1.0, _rng(), duration_s=100.0)
    assert offsets[0] == 0.0 and offsets[-1] < 100.0
    assert len(offsets) == pytest.approx(5000, rel=0.05)
    both = arrival_offsets(50.0, 1.0, _rng(), count=100, duration_s=100.0)
    assert len(both) == 100  # the count ends it first
    short = arrival_offsets(50.0, 1.0, _rng(), count=10_000, duration_s=1.0)
    assert short[-1] < 1.0 and len(short) < 10_000  # the duration ends it first


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate": 0.0, "burstiness": 1.0, "count": 3}, "rate must be"),
        ({"rate": 1.0, "burstiness": 0.0, "count": 3}, "burstiness must be"),
        ({"rate": 1.0, "burstiness": 1.0}, "needs a count or a duration"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        arrival_offsets(rng=_rng(), **kwargs)
