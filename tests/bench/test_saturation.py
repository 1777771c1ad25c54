"""The saturation rule on synthetic sweep curves."""

from __future__ import annotations

import math

import pytest

from kvpilot.bench.config import SaturationRule
from kvpilot.bench.saturation import SweepPoint, find_saturation

RULE = SaturationRule()  # latency factor 2, min gain 5 %, min efficiency 0.8


def _sweep(loads, achieved, latencies, offered=None) -> list[SweepPoint]:
    offered = loads if offered is None else offered
    return [
        SweepPoint(load=load, achieved_rps=a, offered_rps=o, latency_s=lat)
        for load, a, o, lat in zip(loads, achieved, offered, latencies, strict=True)
    ]


def test_throughput_plateau_is_the_knee():
    points = _sweep(
        [1, 2, 4, 8, 16],
        [1.0, 2.0, 3.9, 4.0, 4.05],
        [0.10, 0.10, 0.11, 0.15, 0.19],
        offered=[1, 2, 4, 4.5, 4.5],
    )
    result = find_saturation(points, RULE, open_loop=False)
    assert (result.saturated, result.knee_index, result.saturation_index) == (True, 3, 2)
    assert "rose +2.6% over the previous point" in result.reason


def test_latency_turning_up_is_the_knee():
    points = _sweep([1, 2, 4, 8], [1.0, 2.0, 3.9, 7.5], [0.10, 0.11, 0.12, 0.35])
    result = find_saturation(points, RULE, open_loop=True)
    assert (result.knee_index, result.saturation_index) == (3, 2)
    assert "ttft_p50 350.0 ms is 3.50× its lowest-load value 100.0 ms (limit 2×)" in result.reason


def test_open_loop_falling_behind_arrivals_is_the_knee():
    # Latency and gain look fine, but only 7 of the 10 offered req/s complete.
    points = _sweep([5, 10], [5.0, 7.0], [0.10, 0.12])
    result = find_saturation(points, RULE, open_loop=True)
    assert (result.knee_index, result.saturation_index) == (1, 0)
    assert "below 0.8 × the offered 10 req/s" in result.reason
    # The efficiency rule does not apply to closed loops (arrivals follow completions there).
    assert find_saturation(points, RULE, open_loop=False).saturated is False


def test_sweep_that_starts_above_capacity():
    result = find_saturation(_sweep([10, 20], [5.0, 5.1], [1.0, 2.0]), RULE, open_loop=True)
    assert (result.saturated, result.knee_index, result.saturation_index) == (True, 0, None)


def test_linear_sweep_is_not_saturated():
    points = _sweep([1, 2, 4, 8], [1.0, 2.0, 4.0, 8.0], [0.1, 0.1, 0.1, 0.1])
    result = find_saturation(points, RULE, open_loop=True)
    assert (result.saturated, result.knee_index, result.saturation_index) == (False, None, 3)


def test_point_without_successes_is_the_knee():
    result = find_saturation(_sweep([1, 2], [1.0, 0.0], [0.1, None]), RULE, open_loop=True)
    assert (result.knee_index, result.reason) == (1, "load 2: no successful request")


def test_infinite_rate_point_is_judged_by_gain_and_latency_only():
    points = _sweep([1, 2, math.inf], [1.0, 2.0, 2.05], [0.1, 0.1, 0.15], offered=[1, 2, math.inf])
    result = find_saturation(points, RULE, open_loop=True)
    assert (result.knee_index, result.saturation_index) == (2, 1)


def test_watched_latency_and_thresholds_come_from_the_rule():
    points = _sweep([1, 2], [1.0, 2.0], [0.1, 0.25])
    assert find_saturation(points, RULE, open_loop=True).knee_index == 1
    lenient = SaturationRule(latency="e2e_p99", latency_factor=3.0)
    assert find_saturation(points, lenient, open_loop=True).saturated is False


def test_loads_must_increase():
    with pytest.raises(ValueError, match="strictly increase"):
        find_saturation(_sweep([2, 1], [1.0, 1.0], [0.1, 0.1]), RULE, open_loop=True)
