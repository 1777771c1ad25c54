"""The operator's own Prometheus metrics: what the alerts on replica readiness are written against.

Per-InferenceService series are removed when the InferenceService goes away (the delete handler), so a
deleted service never keeps firing "replicas not ready".
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kvpilot.operator.crd_schema import PHASES

REGISTRY = CollectorRegistry()
LABELS = ("namespace", "inferenceservice")

DESIRED = Gauge(
    "kvpilot_operator_inferenceservice_desired_replicas",
    "Replicas the N+1 sizing asks for (serving + spare).",
    LABELS,
    registry=REGISTRY,
)
SPARE = Gauge(
    "kvpilot_operator_inferenceservice_spare_replicas",
    "Replicas on top of what carries the load, after the min/max clamp.",
    LABELS,
    registry=REGISTRY,
)
SERVING = Gauge(
    "kvpilot_operator_inferenceservice_serving_replicas",
    "Replicas needed to carry the load within the SLO (N), before the spare and the maxReplicas clamp: "
    "what the capacity alert compares the ready replicas with.",
    LABELS,
    registry=REGISTRY,
)
READY = Gauge(
    "kvpilot_operator_inferenceservice_ready_replicas",
    "Replicas whose engine is loaded, warmed up and Ready.",
    LABELS,
    registry=REGISTRY,
)
PHASE = Gauge(
    "kvpilot_operator_inferenceservice_phase",
    "1 for the current phase of the InferenceService, 0 for the others.",
    (*LABELS, "phase"),
    registry=REGISTRY,
)
RECONCILIATIONS = Counter(
    "kvpilot_operator_reconciliations_total",
    "Reconciliations by result (applied, unchanged, invalid, error).",
    ("result",),
    registry=REGISTRY,
)
COLD_START = Histogram(
    "kvpilot_operator_replica_cold_start_seconds",
    "Pod creation to Ready of engine replicas: scheduling, image pull, load, warm-up.",
    buckets=(5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600),
    registry=REGISTRY,
)


ARRIVAL_RATE = Gauge(
    "kvpilot_operator_autoscaler_arrival_rate",
    "Arrival rate the autoscaler measured (requests/s, all engines of the InferenceService).",
    LABELS,
    registry=REGISTRY,
)
GOODPUT = Gauge(
    "kvpilot_operator_autoscaler_goodput_per_replica",
    "Per-replica goodput under the SLO the autoscaler used (requests/s; measured or the spec's).",
    LABELS,
    registry=REGISTRY,
)
RECOMMENDED = Gauge(
    "kvpilot_operator_autoscaler_recommended_replicas",
    "The autoscaler's clamped recommendation for the last measurement, before the stabilisation windows.",
    LABELS,
    registry=REGISTRY,
)
SCALE_EVENTS = Counter(
    "kvpilot_operator_autoscaler_scale_events_total",
    "Replica count changes the autoscaler made, by reason (ScaledUp, ScaledDown).",
    (*LABELS, "reason"),
    registry=REGISTRY,
)
SCALE_REASONS = ("ScaledUp", "ScaledDown")
_AUTOSCALER_GAUGES = (ARRIVAL_RATE, GOODPUT, RECOMMENDED)


def record_autoscaler(
    namespace: str, name: str, arrival: float | None, goodput: float, recommended: int
) -> None:
    if arrival is not None:
        ARRIVAL_RATE.labels(namespace, name).set(arrival)
    GOODPUT.labels(namespace, name).set(goodput)
    RECOMMENDED.labels(namespace, name).set(recommended)


def record_status(
    namespace: str, name: str, *, desired: int, spare: int, serving: int, ready: int, phase: str
) -> None:
    DESIRED.labels(namespace, name).set(desired)
    SERVING.labels(namespace, name).set(serving)
    SPARE.labels(namespace, name).set(spare)
    READY.labels(namespace, name).set(ready)
    for candidate in PHASES:
        PHASE.labels(namespace, name, candidate).set(1 if candidate == phase else 0)


def forget(namespace: str, name: str) -> None:
    for gauge in (DESIRED, SPARE, SERVING, READY, *_AUTOSCALER_GAUGES):
        with contextlib.suppress(KeyError):
            gauge.remove(namespace, name)
    for candidate in PHASES:
        with contextlib.suppress(KeyError):
            PHASE.remove(namespace, name, candidate)
    for reason in SCALE_REASONS:
        with contextlib.suppress(KeyError):
            SCALE_EVENTS.remove(namespace, name, reason)


def serve(port: int) -> None:
    start_http_server(port, registry=REGISTRY)
