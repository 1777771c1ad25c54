"""Finding where a load sweep saturates the endpoint.

The rule, over the sweep's points in increasing load (request rate, or concurrency for closed loop):
the *knee* is the first point at which any of these holds
  1. no request succeeded (there is no latency to read);
  2. open loop: achieved request throughput < ``min_efficiency`` × the arrival rate the schedule actually
     offered (the endpoint no longer keeps up with arrivals; the actual rather than the nominal rate, so
     sampling noise of a short schedule does not fire the rule);
  3. the watched latency (``SaturationRule.latency``, default p50 TTFT) exceeds ``latency_factor`` × its
     value at the lowest load (latency turns sharply up: queueing has started);
  4. achieved request throughput rose by less than ``min_throughput_gain`` (a fraction) over the previous
     point (throughput stopped rising although the offered load rose).
The *saturation point* is the point just before the knee: the highest load the endpoint sustained, and the
throughput to quote together with its latency. With no knee, the sweep did not reach saturation and its last
point is only a lower bound; a knee at the first point means the sweep started above capacity. Rule 4
presumes geometrically spaced load levels (e.g. ×1.5 or ×2 per step), as sweeps usually are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from kvpilot.bench.config import SaturationRule


@dataclass(frozen=True)
class SweepPoint:
    load: float  # offered request rate in req/s (open loop; may be inf) or concurrency (closed loop)
    achieved_rps: float  # achieved request throughput
    offered_rps: float  # arrival rate the schedule actually offered (open loop; inf when all at once)
    latency_s: float | None  # the watched latency figure; None when no request succeeded


@dataclass(frozen=True)
class SaturationResult:
    saturated: bool  # a knee was found
    knee_index: int | None  # index of the first point that broke the rule
    saturation_index: int | None  # index of the point before the knee (None: knee at the first point)
    reason: str  # which rule fired, with the numbers, or why none did


def find_saturation(
    points: Sequence[SweepPoint], rule: SaturationRule, *, open_loop: bool
) -> SaturationResult:
    if not points:
        raise ValueError("no sweep points")
    loads = [p.load for p in points]
    if any(later <= earlier for earlier, later in pairwise(loads)):
        raise ValueError(f"sweep loads must strictly increase (got {loads})")

    baseline = points[0].latency_s
    for index, point in enumerate(points):
        reason = _broken_rule(index, point, points, baseline, rule, open_loop)
        if reason is not None:
            before = index - 1 if index > 0 else None
            return SaturationResult(saturated=True, knee_index=index, saturation_index=before, reason=reason)
    return SaturationResult(
        saturated=False,
        knee_index=None,
        saturation_index=len(points) - 1,
        reason="no point broke the rule: not saturated within the sweep (the last point is a lower bound)",
    )


def _broken_rule(
    index: int,
    point: SweepPoint,
    points: Sequence[SweepPoint],
    baseline: float | None,
    rule: SaturationRule,
    open_loop: bool,
) -> str | None:
    label = f"load {point.load:g}"
    if point.latency_s is None:
        return f"{label}: no successful request"
    offered = point.offered_rps
    if open_loop and math.isfinite(offered) and point.achieved_rps < rule.min_efficiency * offered:
        return (
            f"{label}: achieved {point.achieved_rps:.3g} req/s is below {rule.min_efficiency:g} × the "
            f"offered {offered:.3g} req/s"
        )
    if index == 0:
        return None
    if baseline is not None and point.latency_s > rule.latency_factor * baseline:
        return (
            f"{label}: {rule.latency} {point.latency_s * 1e3:.1f} ms is {point.latency_s / baseline:.2f}× "
            f"its lowest-load value {baseline * 1e3:.1f} ms (limit {rule.latency_factor:g}×)"
        )
    previous = points[index - 1].achieved_rps
    if point.achieved_rps < (1.0 + rule.min_throughput_gain) * previous:
        gain = point.achieved_rps / previous - 1.0 if previous > 0 else 0.0
        return (
            f"{label}: achieved throughput rose {gain:+.1%} over the previous point "
            f"(needs at least +{rule.min_throughput_gain:.0%})"
        )
    return None
