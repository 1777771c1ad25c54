"""The ``status`` block of the schema: phase, conditions, counts, the sizing decision and cold starts."""

from __future__ import annotations

from typing import Any

from kvpilot.operator.schema_types import count, seconds

PHASES = ("Pending", "Loading", "WarmingUp", "Ready", "Degraded", "Failed", "Idle")
CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "CapacityLimited", "SpareAvailable")


def _condition() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "One condition, as Kubernetes conditions are written.",
        "required": ["type", "status"],
        "properties": {
            "type": {
                "type": "string",
                "enum": list(CONDITION_TYPES),
                "description": "Ready: phase Ready; Progressing: a rollout phase (Pending, Loading, "
                "WarmingUp); Degraded: phase Degraded or Failed; CapacityLimited: the replicas the load "
                "needs (N) exceed scaling.maxReplicas; SpareAvailable: a replica may go (drain, failure, "
                "rollout) without dropping below N.",
            },
            "status": {
                "type": "string",
                "enum": ["True", "False", "Unknown"],
                "description": "Whether the condition holds.",
            },
            "reason": {
                "type": "string",
                "maxLength": 1024,
                "description": "Machine-readable cause: ReplicasReady, RolloutInProgress, ReplicasFailing, "
                "ReplicasLost, ScaledToZero, InvalidSpec (Progressing: Idle outside a rollout); "
                "CapacityLimited: MaxReplicasReached, WithinMaxReplicas or ExternalReplicas (mode external "
                "follows spec.replicas unclamped); SpareAvailable: SpareReplicas, NoSpare, SpareClamped or "
                "ScaledToZero.",
            },
            "message": {
                "type": "string",
                "maxLength": 32768,
                "description": "What a person should read: ready/desired counts and failing pods, or the "
                "invalid field.",
            },
            "lastTransitionTime": {
                "type": "string",
                "format": "date-time",
                "description": "When status last flipped.",
            },
            "observedGeneration": {
                "type": "integer",
                "format": "int64",
                "minimum": 0,
                "description": "metadata.generation this condition was computed for.",
            },
        },
    }


def _number(description: str) -> dict[str, Any]:
    return {"type": "number", "minimum": 0, "description": description}


def _sizing() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "Inputs and result of the replica sizing (docs/architecture.md#replica-sizing), and "
        "the autoscaler's last decision with its inputs (docs/architecture.md#autoscaling).",
        "properties": {
            "mode": {
                "type": "string",
                "enum": ["Replicas", "Rate", "External", "Autoscaler"],
                "description": "Replicas: from scaling.replicas; Rate: from scaling.targetRequestsPerSecond "
                "and scaling.perReplicaGoodput; External: spec.replicas (autoscaling.mode external); "
                "Autoscaler: the operator's autoscaler (autoscaling.mode operator).",
            },
            "replicas": count("scaling.replicas (mode Replicas)."),
            "specReplicas": count("spec.replicas (mode External), as the scale subresource set it."),
            "targetRequestsPerSecond": {
                "type": "number",
                "description": "scaling.targetRequestsPerSecond (mode Rate).",
            },
            "perReplicaGoodput": {
                "type": "number",
                "description": "scaling.perReplicaGoodput (modes Rate and Autoscaler).",
            },
            "headroom": {"type": "number", "description": "scaling.headroom (modes Rate and Autoscaler)."},
            "spare": count("scaling.spare."),
            "minReplicas": count("scaling.minReplicas."),
            "maxReplicas": count("scaling.maxReplicas."),
            "serving": count("Replicas that carry the load (N)."),
            "unclamped": count("N + spare, before the min/max clamp."),
            "desiredReplicas": count(
                "The clamped result (mode Autoscaler: after the stabilisation windows)."
            ),
            "capacityLimited": {
                "type": "boolean",
                "description": "N alone exceeds scaling.maxReplicas: the clamp leaves the load short of "
                "capacity (condition CapacityLimited); never in mode external with spec.replicas set, "
                "which runs unclamped.",
            },
            "formula": {"type": "string", "description": "The arithmetic with its numbers."},
            "arrivalRate": _number("Mode Autoscaler: measured arrival rate, requests/s (λ)."),
            "goodput": _number("Mode Autoscaler: per-replica goodput the decision used, requests/s (g)."),
            "goodputSource": {
                "type": "string",
                "enum": ["Spec", "Measured"],
                "description": "Spec: scaling.perReplicaGoodput (too few saturated windows measured yet); "
                "Measured: the median of the engines' goodput in saturated windows.",
            },
            "goodputSamples": count("Saturated windows measured so far (the last ones are kept)."),
            "signalSource": {
                "type": "string",
                "enum": ["Pods", "Prometheus"],
                "description": "Where the rates came from: the engines' /metrics or "
                "autoscaling.prometheusUrl.",
            },
            "measuredEngines": count("Engines whose counters the last measurement covered."),
            "recommendation": count(
                "The clamped count for the last measurement alone, before stabilisation."
            ),
            "decision": {
                "type": "string",
                "enum": ["ScaleUp", "ScaleDown", "Hold", "NoSignal"],
                "description": "What the last evaluation did (NoSignal: no rate measured yet, count kept).",
            },
            "message": {"type": "string", "description": "Why, in words, with the windows that held it."},
            "decidedAt": {"type": "string", "format": "date-time", "description": "Last evaluation."},
            "lastScaleTime": {
                "type": "string",
                "format": "date-time",
                "description": "When the autoscaler last changed the count.",
            },
        },
    }


def status_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "Observed state, written by the operator.",
        "properties": {
            "phase": {
                "type": "string",
                "enum": list(PHASES),
                "description": "Ready: every desired replica serves; Pending, Loading, WarmingUp: a rollout, "
                "named by its slowest replica; Degraded: some serve, a replica fails or was lost; Failed: "
                "none serves and a replica fails, the rollout stalled, or the spec is invalid; Idle: "
                "scaled to zero (no replica desired, none serves).",
            },
            "conditions": {
                "type": "array",
                "items": _condition(),
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
                "description": "Ready, Progressing and Degraded, one of each; CapacityLimited and "
                "SpareAvailable once the spec is valid.",
            },
            "replicas": count("Engine pods that exist (any stage)."),
            "readyReplicas": count("Replicas whose engine is loaded, warmed up and Ready."),
            "desiredReplicas": count("Replicas the N+1 sizing asks for (serving + spare)."),
            "observedGeneration": {
                "type": "integer",
                "format": "int64",
                "minimum": 0,
                "description": "metadata.generation of the spec this status describes.",
            },
            "endpoint": {
                "type": "string",
                "description": "In-cluster URL of the client Service (the routers), "
                "http://<name>.<namespace>.svc.<cluster domain> (the operator's --cluster-domain, "
                "cluster.local by default); OpenAI paths under /v1.",
            },
            "sizing": _sizing(),
            "selector": {
                "type": "string",
                "description": "Label selector of the engine pods, as the scale subresource reports it "
                "(an HPA reads pod metrics through it).",
            },
            "engines": {
                "type": "object",
                "description": "Replicas by warm-up stage.",
                "properties": {
                    "pending": count(
                        "Desired replicas whose engine has not started: no pod yet, not scheduled, "
                        "or the container waiting (e.g. pulling its image)."
                    ),
                    "loading": count("Engines loading weights and allocating the KV cache."),
                    "warmingUp": count("Engines running their warm-up passes (and kernel tuning on CUDA)."),
                    "ready": count("Engines Ready to serve."),
                    "failing": count(
                        "Pods that will not serve without a change: crash loop, image pull or container "
                        "config errors, a terminated engine or a failed pod."
                    ),
                },
            },
            "coldStart": {
                "type": "object",
                "description": "Pod creation to Ready, for recently started replicas.",
                "properties": {
                    "samples": count("Replicas measured since the InferenceService was created."),
                    "lastSeconds": seconds("Cold start of the replica that turned Ready last."),
                    "maxSeconds": seconds("Longest cold start measured."),
                    "recent": {
                        "type": "array",
                        "maxItems": 5,
                        "description": "The latest replicas to turn Ready, newest first.",
                        "items": {
                            "type": "object",
                            "description": "One replica's cold start.",
                            "properties": {
                                "pod": {"type": "string", "description": "Pod name."},
                                "seconds": seconds("Pod creation to Ready."),
                                "readyAt": {
                                    "type": "string",
                                    "format": "date-time",
                                    "description": "When the pod turned Ready.",
                                },
                            },
                        },
                    },
                },
            },
        },
    }
