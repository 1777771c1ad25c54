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
