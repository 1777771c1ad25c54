"""The ``spec.scaling`` block of the schema: the N+1 sizing inputs (docs/architecture.md#replica-sizing)."""

from __future__ import annotations

from typing import Any

from kvpilot.operator.schema_types import integer, number, obj


def scaling_schema() -> dict[str, Any]:
    return obj(
        "Replica count: either `replicas`, or `targetRequestsPerSecond` with `perReplicaGoodput`. "
        "desired = clamp(ceil(target × (1 + headroom) / goodput) + spare, min, max), or replicas + spare.",
        {
            "replicas": integer("Serving replicas, not counting the spare ones.", 1, 1000),
            "targetRequestsPerSecond": number("Peak arrival rate to serve.", 0, 1_000_000),
            "perReplicaGoodput": number(
                "Requests/s one replica serves within the SLO.", 0, 1_000_000, exclusive_minimum=True
            ),
            "headroom": number("Extra capacity over the target rate, as a fraction.", 0, 10, default=0.2),
            "spare": integer("Replicas kept on top for failures and rollouts (N+1).", 0, 100, 1),
            "minReplicas": integer("Lower clamp of the desired replicas.", 0, 1000, 1),
            "maxReplicas": integer("Upper clamp of the desired replicas.", 1, 1000, 100),
            "requireHostSpread": {
                "type": "boolean",
                "default": False,
                "description": "Never put two replicas on one node (hard constraint); "
                "by default spreading over nodes is preferred, not required.",
            },
        },
        ("spec", "scaling"),
    )


#: autoscaling.mode: who sets the replica count (docs/architecture.md#autoscaling)
AUTOSCALING_MODES = ("off", "operator", "external")


def replicas_schema() -> dict[str, Any]:
    """``spec.replicas``: the scale subresource's spec replicas path."""
    return integer(
        "Total replicas (spare included) in autoscaling.mode external: the scale subresource's replicas, "
        "as `kubectl scale`, a HorizontalPodAutoscaler or a KEDA ScaledObject set them; the operator "
        "follows it and never changes it. Ignored in the other modes (status.sizing says the count).",
        0,
        1000,
    )


def autoscaling_schema() -> dict[str, Any]:
    return obj(
        "Who sets the replica count. off: the scaling block, statically. operator: the operator's "
        "autoscaler, desired = clamp(ceil(arrival rate × (1 + headroom) / goodput) + spare, min, max) "
        "from the engines' measured request and SLO counters, with stabilisation windows and a cooldown. "
        "external: spec.replicas, through the scale subresource (an HPA, KEDA, kubectl scale).",
        {
            "mode": {
                "type": "string",
                "enum": list(AUTOSCALING_MODES),
                "default": "off",
                "description": "off (quote it in YAML: a bare off reads as false), operator or external.",
            },
            "prometheusUrl": {
                "type": "string",
                "pattern": r"^https?://[^\s/]+(/\S*)?$",
                "maxLength": 512,
                "description": "Read the signals from this Prometheus (its /api/v1/query) instead of "
                "scraping the engines' /metrics; the series need the labels namespace, pod and "
                "inferenceservice (the chart's PodMonitor adds them).",
            },
            "intervalSeconds": integer("How often the autoscaler measures and decides.", 1, 3600, 15),
            "rateWindowSeconds": integer(
                "Window of the rates (arrival, per-replica goodput), as a PromQL rate() range.", 2, 3600, 60
            ),
            "scaleUpStabilizationSeconds": integer(
                "Scale up to the lowest count recommended within this window (0: at once).", 0, 3600, 0
            ),
            "scaleDownStabilizationSeconds": integer(
                "Scale down only to the highest count recommended within this window.", 0, 86400, 300
            ),
            "cooldownSeconds": integer(
                "No scale-down sooner than this after any scale change.", 0, 86400, 60
            ),
            "idleTimeoutSeconds": integer(
                "With scaling.minReplicas 0: scale to zero after no request arrived for this long; the "
                "activator then holds requests and wakes the service (docs/architecture.md#scale-to-zero).",
                1,
                86400,
                300,
            ),
            "activatorHoldSeconds": integer(
                "At zero, how long the activator holds a request for a replica to turn Ready before it "
                "answers 503 with Retry-After (longer than a cold start).",
                1,
                3600,
                300,
            ),
            "minGoodputSamples": integer(
                "Saturated measurement windows before the measured per-replica goodput replaces "
                "scaling.perReplicaGoodput.",
                1,
                1000,
                3,
            ),
        },
        ("spec", "autoscaling"),
    )
