"""The operator's autoscaler (autoscaling.mode operator): signals in, a ``SizingResult`` out, per service
(docs/architecture.md#autoscaling).

Each evaluation (every ``autoscaling.intervalSeconds``; a reconcile in between reuses the last one, so
watch events add no samples) measures the engines' rates (``signals``), updates the per-replica goodput
estimate and asks ``autoscale_decision.decide`` for the count. State lives in this process: the windows'
history, the samples and the goodput samples; the count and the last scale time are read back from the
status after a restart, so a new leader continues where the old one stopped (its windows start empty).

**Goodput** g: an engine is *saturated* in a window when requests wait in its queue at the window's end or
fewer than ``SATURATED_ATTAINMENT`` of the requests it finished met the SLO; its attained rate then is a
sample of what one replica serves within the SLO. g is the median of the last ``GOODPUT_SAMPLES_KEPT``
positive samples once there are ``minGoodputSamples``, the spec's ``perReplicaGoodput`` until then. An
engine that is never saturated gives no sample: it serves all it is given, which says nothing of its limit.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from kvpilot.operator import metrics
from kvpilot.operator.autoscale_decision import (
    SCALE_UP,
    Decision,
    Inputs,
    Policy,
    Recommendation,
    decide,
)
from kvpilot.operator.signals import (
    EngineRates,
    EngineSample,
    SampleWindow,
    prometheus_rates,
    read_activator_metrics,
    read_engine_metrics,
)
from kvpilot.operator.sizing import SizingResult, size_replicas
from kvpilot.operator.spec import InferenceService

SATURATED_ATTAINMENT = 0.9
GOODPUT_SAMPLES_KEPT = 10
#: a reconcile this soon (as a fraction of the interval) after an evaluation reuses it
REUSE_FRACTION = 0.8

Key = tuple[str, str]
MetricsReader = Callable[[str, int], "EngineSample | None"]
PrometheusReader = Callable[[str, str, str, int], "list[EngineRates] | None"]
ActivatorReader = Callable[[str, int], "tuple[float, float] | None"]


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str  # ScaledUp, ScaledDown, CapacityLimited
    message: str


@dataclass(frozen=True)
class Evaluation:
    sizing: SizingResult
    events: tuple[Event, ...]
    next_in: float  # seconds until the next evaluation is due


@dataclass
class _State:
    window: SampleWindow
    generation: int
    current: int | None = None
    last_scale_at: float | None = None
    last_eval_at: float | None = None
    history: tuple[Recommendation, ...] = ()
    goodput_samples: deque[float] = field(default_factory=lambda: deque(maxlen=GOODPUT_SAMPLES_KEPT))
    last: SizingResult | None = None
    capacity_limited: bool = False
    last_demand_at: float | None = None  # an arrival measured or a request held by the activator
    activator_held_total: float | None = None


def _iso(moment: float) -> str:
    return datetime.fromtimestamp(moment, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_iso(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def saturated(rates: EngineRates) -> bool:
    if rates.waiting > 0:
        return True
    return rates.finished > 0 and rates.attained / rates.finished < SATURATED_ATTAINMENT


class Autoscaler:
    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        read_metrics: MetricsReader = read_engine_metrics,
        read_prometheus: PrometheusReader = prometheus_rates,
        read_activator: ActivatorReader = read_activator_metrics,
    ) -> None:
        self._clock, self._read_metrics, self._read_prometheus = clock, read_metrics, read_prometheus
        self._read_activator = read_activator
        self._states: dict[Key, _State] = {}

    def forget(self, key: Key) -> None:
        self._states.pop(key, None)

    def _state(self, isvc: InferenceService, previous: dict[str, Any]) -> _State:
        key = (isvc.namespace, isvc.name)
        state = self._states.get(key)
        window = isvc.spec.autoscaling.rate_window_seconds
        if state is None or state.window.window != window:
            state = _State(window=SampleWindow(window), generation=isvc.generation)
            sizing = previous.get("sizing", {})
            if sizing.get("mode") == "Autoscaler":  # continue after a restart or a leader change
                state.current = sizing.get("desiredReplicas")
                state.last_scale_at = _parse_iso(sizing.get("lastScaleTime"))
            self._states[key] = state
        return state

    def _rates(
        self, isvc: InferenceService, engines: dict[str, tuple[str, int]], state: _State, now: float
    ) -> tuple[str, list[EngineRates] | None]:
        autoscaling = isvc.spec.autoscaling
        if autoscaling.prometheus_url:
            return "Prometheus", self._read_prometheus(
                autoscaling.prometheus_url, isvc.namespace, isvc.name, autoscaling.rate_window_seconds
            )
        samples = {pod: self._read_metrics(*address) for pod, address in sorted(engines.items())}
        state.window.add(now, {pod: sample for pod, sample in samples.items() if sample is not None})
        return "Pods", state.window.rates()

    def _woken(self, state: _State, activator: tuple[str, int] | None) -> bool:
        """Whether the activator holds requests now, or held one since the last evaluation."""
        sample = self._read_activator(*activator) if activator is not None else None
        if sample is None:
            return False
        held, held_total = sample
        before, state.activator_held_total = state.activator_held_total, held_total
        return held > 0 or (before is not None and held_total > before)

    def evaluate(
        self,
        isvc: InferenceService,
        engines: dict[str, tuple[str, int]],
        previous: dict[str, Any],
        activator: tuple[str, int] | None = None,
    ) -> Evaluation:
        """``engines``: the Ready engine pods' (IP, port) by pod name; ``previous``: the current status;
        ``activator``: the Ready activator's address, for a service that scales to zero."""
        autoscaling, scaling = isvc.spec.autoscaling, isvc.spec.scaling
        state, now = self._state(isvc, previous), self._clock()
        interval = float(autoscaling.interval_seconds)
        if (
            state.last is not None
            and state.last_eval_at is not None
            and state.generation == isvc.generation
            and now - state.last_eval_at < REUSE_FRACTION * interval
        ):
            return Evaluation(state.last, (), interval - (now - state.last_eval_at))
        state.generation, state.last_eval_at = isvc.generation, now
        source, rates = self._rates(isvc, engines, state, now)
        arrival = sum(r.arrival for r in rates) if rates else None
        for engine in rates or ():
            if saturated(engine) and engine.attained > 0:
                state.goodput_samples.append(engine.attained)
        measured = len(state.goodput_samples) >= autoscaling.min_goodput_samples
        spec_goodput = scaling.per_replica_goodput or 1.0  # the CRD requires it in this mode
        goodput = statistics.median(state.goodput_samples) if measured else spec_goodput
        if state.current is None:
            state.current = size_replicas(scaling).desired
        woken = self._woken(state, activator)
        if woken or (arrival is not None and arrival > 0) or state.last_demand_at is None:
            state.last_demand_at = now
        min_replicas, spare = scaling.min_replicas, scaling.spare
        if isvc.spec.scales_to_zero:
            # Zero only after idleTimeoutSeconds without an arrival (then without spare either); until
            # then at least one replica stays, and a held request brings one back at once.
            idle = (
                not woken and not arrival and now - state.last_demand_at >= autoscaling.idle_timeout_seconds
            )
            min_replicas, spare = (0, 0) if idle else (1, spare)
        policy = Policy(
            headroom=scaling.headroom,
            spare=spare,
            min_replicas=min_replicas,
            max_replicas=scaling.max_replicas,
            up_window_seconds=autoscaling.scale_up_stabilization_seconds,
            down_window_seconds=autoscaling.scale_down_stabilization_seconds,
            cooldown_seconds=autoscaling.cooldown_seconds,
        )
        decision = decide(
            Inputs(now, state.current, arrival, goodput, state.history, state.last_scale_at), policy
        )
        state.history = decision.history
        events = []
        if decision.changed:
            reason = "ScaledUp" if decision.decision == SCALE_UP else "ScaledDown"
            events.append(Event("Normal", reason, f"{decision.message}; {decision.formula}"))
            metrics.SCALE_EVENTS.labels(isvc.namespace, isvc.name, reason).inc()
            state.current, state.last_scale_at = decision.desired, now
        sizing = self._sizing(isvc, decision, arrival, goodput, measured, state, source, rates, now)
        if sizing.capacity_limited and not state.capacity_limited:
            events.append(
                Event(
                    "Warning",
                    "CapacityLimited",
                    f"{decision.serving} replicas needed to serve {arrival:.4g} requests/s within the SLO, "
                    f"scaling.maxReplicas is {scaling.max_replicas}",
                )
            )
        state.capacity_limited, state.last = sizing.capacity_limited, sizing
        metrics.record_autoscaler(isvc.namespace, isvc.name, arrival, goodput, decision.recommendation)
        return Evaluation(sizing, tuple(events), interval)

    @staticmethod
    def _sizing(
        isvc: InferenceService,
        decision: Decision,
        arrival: float | None,
        goodput: float,
        measured: bool,
        state: _State,
        source: str,
        rates: list[EngineRates] | None,
        now: float,
    ) -> SizingResult:
        extra: list[tuple[str, Any]] = []
        if arrival is not None:
            extra.append(("arrivalRate", round(arrival, 4)))
        extra += [
            ("goodput", round(goodput, 4)),
            ("goodputSource", "Measured" if measured else "Spec"),
            ("goodputSamples", len(state.goodput_samples)),
            ("signalSource", source),
            ("measuredEngines", len(rates or ())),
            ("recommendation", decision.recommendation),
            ("decision", decision.decision),
            ("message", decision.message),
            ("decidedAt", _iso(now)),
        ]
        if state.last_scale_at is not None:
            extra.append(("lastScaleTime", _iso(state.last_scale_at)))
        return SizingResult(
            mode="Autoscaler",
            scaling=isvc.spec.scaling,
            serving=decision.serving,
            unclamped=decision.unclamped,
            desired=decision.desired,
            formula_text=decision.formula,
            extra=tuple(extra),
        )
