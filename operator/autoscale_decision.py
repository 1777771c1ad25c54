"""The autoscaler's decision, pure: measured rates, the windows' history and a clock in, a count out
(docs/architecture.md#autoscaling).

recommendation = clamp(ceil(λ × (1 + headroom) / g) + spare, minReplicas, maxReplicas), λ the measured
arrival rate, g the per-replica goodput under the SLO. Like the HorizontalPodAutoscaler's behavior:

- **up fast**: scale up to the *lowest* recommendation of the scale-up window (0 s: the current one), so
  one noisy measurement does not add replicas when the window is set;
- **down slow**: scale down only to the *highest* recommendation of the scale-down window, so the count
  falls only after the load has stayed low for the whole window;
- **cooldown**: no scale-down sooner than ``cooldown`` after any change (a new replica's own warm-up
  and the rate window's lag must not read as lower load); scale-ups are never held by it;
- the bounds win at once: a count outside [min, max] (the spec changed) moves to the bound.

Arithmetic is exact on the decimal values (as ``sizing``): a load that is an exact multiple of the
goodput never rounds up to one replica too many. Times are seconds on the caller's clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

SCALE_UP, SCALE_DOWN, HOLD, NO_SIGNAL = "ScaleUp", "ScaleDown", "Hold", "NoSignal"


@dataclass(frozen=True)
class Policy:
    headroom: float
    spare: int
    min_replicas: int
    max_replicas: int
    up_window_seconds: float = 0.0
    down_window_seconds: float = 300.0
    cooldown_seconds: float = 60.0


@dataclass(frozen=True)
class Recommendation:
    at: float  # when it was made
    replicas: int  # clamped


@dataclass(frozen=True)
class Inputs:
    now: float
    current: int  # the count in force (the Deployment's replicas as last decided)
    arrival_rate: float | None  # λ, requests/s; None when nothing has been measured yet
    goodput: float  # g, requests/s per replica (> 0)
    history: tuple[Recommendation, ...] = ()  # earlier recommendations, oldest first
    last_scale_at: float | None = None  # when the count last changed


@dataclass(frozen=True)
class Decision:
    decision: str  # ScaleUp, ScaleDown, Hold or NoSignal
    desired: int  # the count to run now
    serving: int  # N = ceil(λ × (1 + headroom) / g); 0 without a signal
    unclamped: int  # N + spare
    recommendation: int  # clamp(N + spare, min, max), before the windows
    history: tuple[Recommendation, ...]  # to pass back next time (pruned to the longer window)
    formula: str
    message: str

    @property
    def changed(self) -> bool:
        return self.decision in (SCALE_UP, SCALE_DOWN)


def exact(value: float) -> Fraction:
    # str() gives the shortest decimal that round-trips: the number as measured or written, not its binary.
    return Fraction(str(value))


def serving_replicas(arrival_rate: float, headroom: float, goodput: float) -> int:
    if goodput <= 0:
        raise ValueError(f"goodput must be positive, got {goodput}")
    return math.ceil(exact(max(0.0, arrival_rate)) * (1 + exact(headroom)) / exact(goodput))


def _clamp(value: int, policy: Policy) -> int:
    return min(max(value, policy.min_replicas), policy.max_replicas)


def _number(value: float) -> str:
    return f"{value:.4g}"


def decide(inputs: Inputs, policy: Policy) -> Decision:
    now, current = inputs.now, inputs.current
    if inputs.arrival_rate is None:
        bounded = _clamp(current, policy)
        kind = HOLD if bounded == current else (SCALE_UP if bounded > current else SCALE_DOWN)
        return Decision(
            decision=NO_SIGNAL if kind == HOLD else kind,
            desired=bounded,
            serving=0,
            unclamped=0,
            recommendation=bounded,
            history=inputs.history,
            formula=f"no arrival rate measured yet: {bounded} kept",
            message=f"no arrival rate measured yet; keeping {bounded}",
        )
    serving = serving_replicas(inputs.arrival_rate, policy.headroom, inputs.goodput)
    unclamped = serving + policy.spare
    recommendation = _clamp(unclamped, policy)
    keep = max(policy.up_window_seconds, policy.down_window_seconds)
    history = (*(r for r in inputs.history if now - r.at <= keep), Recommendation(now, recommendation))
    up_target = min(r.replicas for r in history if now - r.at <= policy.up_window_seconds)
    down_target = max(r.replicas for r in history if now - r.at <= policy.down_window_seconds)
    formula = (
        f"clamp(ceil({_number(inputs.arrival_rate)} × (1 + {_number(policy.headroom)}) / "
        f"{_number(inputs.goodput)}) + {policy.spare}, {policy.min_replicas}, {policy.max_replicas}) "
        f"= {recommendation}"
    )
    bounded = _clamp(current, policy)
    if bounded != current:
        kind, desired = (SCALE_UP if bounded > current else SCALE_DOWN), bounded
        message = f"{current} -> {bounded}: outside [{policy.min_replicas}, {policy.max_replicas}]"
    elif up_target > current:
        kind, desired = SCALE_UP, up_target
        message = (
            f"{current} -> {up_target}: lowest recommendation of the last {policy.up_window_seconds:g} s"
        )
    elif down_target < current:
        since = None if inputs.last_scale_at is None else now - inputs.last_scale_at
        if since is not None and since < policy.cooldown_seconds:
            kind, desired = HOLD, current
            message = (
                f"{current} kept: {down_target} recommended, but the last change was {since:g} s ago "
                f"(cooldown {policy.cooldown_seconds:g} s)"
            )
        else:
            kind, desired = SCALE_DOWN, down_target
            message = (
                f"{current} -> {down_target}: highest recommendation of the last "
                f"{policy.down_window_seconds:g} s"
            )
    else:
        kind, desired = HOLD, current
        message = f"{current} kept: recommendations of the windows span {up_target}..{down_target}"
    return Decision(
        decision=kind,
        desired=desired,
        serving=serving,
        unclamped=unclamped,
        recommendation=recommendation,
        history=history,
        formula=formula,
        message=message,
    )
