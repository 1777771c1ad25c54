"""The one schema source of the InferenceService API (OpenAPI v3, structural, as a CRD wants it).

The CRD in ``crds/`` and in the Helm chart is generated from this module (see ``crd.py``); the operator
validates and defaults specs against the same dicts (see ``spec.py``). Bounds, enums and defaults live
here; cross-field rules live in ``crd_rules.py`` and are attached below as ``x-kubernetes-validations``.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from kvpilot.operator.crd_rules import CPU_KV_CACHE_MEMORY, rules_for
from kvpilot.router.config import POLICIES, ScoringWeights

#: the router's cost-term knobs, straight from its config (one source of truth for the CRD and the router)
ROUTER_WEIGHT_KEYS = tuple(f.name for f in fields(ScoringWeights))

# Kubernetes' own resource.Quantity grammar, without a sign: memory and KV sizes are never negative.
QUANTITY_PATTERN = r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
# Model sources the engine resolves: a bundled name, an absolute path inside the image or on a
# mounted volume, or pvc://<claim>[/<path in the claim>] (the operator mounts the claim read-only).
MODEL_SOURCE_PATTERN = r"^(smollm2-135m|tiny-random|/\S+|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/\S*)?)$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"

PHASES = ("Pending", "Loading", "WarmingUp", "Ready", "Degraded", "Failed")
CONDITION_TYPES = ("Ready", "Progressing", "Degraded")
ROUTER_POLICIES = POLICIES
DTYPES = ("auto", "float32", "float16", "bfloat16")
BLOCK_SIZES = (8, 16, 32, 64, 128)
# One engine uses one device: more GPUs per replica would need tensor parallelism, which does not exist yet.
MAX_GPUS_PER_REPLICA = 1


def _integer(description: str, minimum: int, maximum: int, default: int | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "integer",
        "format": "int32",
        "minimum": minimum,
        "maximum": maximum,
        "description": description,
    }
    if default is not None:
        schema["default"] = default
    return schema


def _number(
    description: str,
    minimum: float,
    maximum: float,
    *,
    exclusive_minimum: bool = False,
    default: float | None = None,
) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "number",
        "minimum": minimum,
        "maximum": maximum,
        "description": description,
    }
    if exclusive_minimum:
        schema["exclusiveMinimum"] = True
    if default is not None:
        schema["default"] = default
    return schema


def _quantity(description: str, default: str | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string", "pattern": QUANTITY_PATTERN, "maxLength": 32}
    if default is not None:
        schema["default"] = default
    return {**schema, "description": description}


def _object(
    description: str,
    properties: dict[str, Any],
    node: tuple[str, ...],
    *,
    required: tuple[str, ...] = (),
    default_empty: bool = True,
) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "description": description, "properties": properties}
    if required:
        schema["required"] = list(required)
    if default_empty:
        # An empty default makes the API server fill in the nested defaults when the block is omitted.
        schema["default"] = {}
    rules = rules_for(node)
    if rules:
        schema["x-kubernetes-validations"] = [
            {"rule": rule.cel, "message": rule.message, "fieldPath": f".{rule.field}"} for rule in rules
        ]
    return schema


def _model() -> dict[str, Any]:
    return _object(
        "Which model to serve and under which name.",
        {
            "source": {
                "type": "string",
                "pattern": MODEL_SOURCE_PATTERN,
                "maxLength": 512,
                "description": "smollm2-135m, tiny-random, an absolute path in the image or on a volume, "
                "or pvc://<claim>/<path> (mounted read-only at /models/<claim>).",
            },
            "servedName": {
                "type": "string",
                "minLength": 1,
                "maxLength": 128,
                "pattern": r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$",
                "description": "Model name clients send in OpenAI requests; defaults to the "
                "InferenceService name.",
            },
            "dtype": {
                "type": "string",
                "enum": list(DTYPES),
                "default": "auto",
                "description": "Weight and activation dtype.",
            },
            "startupTimeoutSeconds": _integer(
                "How long the engine may take to load and start serving /health before Kubernetes restarts "
                "it; defaults to an estimate from the model's size.",
                30,
                86400,
            ),
        },
        ("spec", "model"),
        required=("source",),
        default_empty=False,
    )


def _engine() -> dict[str, Any]:
    return _object(
        "Engine settings, passed to `kvpilot serve`.",
        {
            "image": {
                "type": "string",
                "minLength": 1,
                "maxLength": 512,
                "description": "Container image for the engine and router; defaults to the operator's.",
            },
            "blockSize": {
                "type": "integer",
                "format": "int32",
                "enum": list(BLOCK_SIZES),
                "default": 16,
                "description": "Tokens per KV block.",
            },
            "maxNumSeqs": _integer("Most sequences in one scheduler step.", 1, 4096, 64),
            "maxNumBatchedTokens": _integer("Token budget of one scheduler step.", 16, 1048576, 2048),
            "enablePrefixCaching": {
                "type": "boolean",
                "default": True,
                "description": "Reuse KV of shared prefixes.",
            },
            "enableChunkedPrefill": {
                "type": "boolean",
                "default": True,
                "description": "Split long prefills across steps, batched with decodes.",
            },
            "kvCacheMemory": _quantity(
                "Memory reserved for the KV cache (e.g. 2Gi). Unset: on GPU the engine sizes the cache from "
                f"gpuMemoryUtilization after loading the weights; on CPU it gets {CPU_KV_CACHE_MEMORY}."
            ),
            "gpuMemoryUtilization": _number(
                "GPU pods without kvCacheMemory: the fraction of the GPU's memory the engine may use for weights, "
                "activations and the KV cache together; ignored on CPU and when kvCacheMemory is set.",
                0,
                1,
                exclusive_minimum=True,
                default=0.9,
            ),
            "extraArgs": {
                "type": "array",
                "maxItems": 64,
                "default": [],
                "items": {"type": "string", "maxLength": 256},
                "description": "More `kvpilot serve` arguments, appended after the ones the spec sets.",
            },
        },
        ("spec", "engine"),
    )


def _resources() -> dict[str, Any]:
    return _object(
        "Compute per replica.",
        {
            "gpus": _integer(
                "GPUs per replica (nvidia.com/gpu): 0 or 1; more would need tensor parallelism, "
                "which is not supported yet.",
                0,
                MAX_GPUS_PER_REPLICA,
                0,
            ),
            "gpuType": {
                "type": "string",
                "minLength": 1,
                "maxLength": 128,
                "description": "GPU product (node label nvidia.com/gpu.product) the replicas must run on.",
            },
            "cpu": _quantity("CPU request per replica.", "2"),
            "memory": _quantity("Memory request and limit per replica.", "8Gi"),
        },
        ("spec", "resources"),
    )


def _slo() -> dict[str, Any]:
    return _object(
        "Latency objectives; a request that meets both counts toward goodput.",
        {
            "ttftSeconds": _number(
                "Time to first token objective.", 0, 600, exclusive_minimum=True, default=2.0
            ),
            "tpotSeconds": _number(
                "Time per output token objective.", 0, 60, exclusive_minimum=True, default=0.1
            ),
        },
        ("spec", "slo"),
    )


def _scaling() -> dict[str, Any]:
    return _object(
        "Replica count: either `replicas`, or `targetRequestsPerSecond` with `perReplicaGoodput`. "
        "desired = clamp(ceil(target × (1 + headroom) / goodput) + spare, min, max), or replicas + spare.",
        {
            "replicas": _integer("Serving replicas, not counting the spare ones.", 1, 1000),
            "targetRequestsPerSecond": _number("Peak arrival rate to serve.", 0, 1_000_000),
            "perReplicaGoodput": _number(
                "Requests/s one replica serves within the SLO.", 0, 1_000_000, exclusive_minimum=True
            ),
            "headroom": _number("Extra capacity over the target rate, as a fraction.", 0, 10, default=0.2),
            "spare": _integer("Replicas kept on top for failures and rollouts (N+1).", 0, 100, 1),
            "minReplicas": _integer("Lower clamp of the desired replicas.", 0, 1000, 1),
            "maxReplicas": _integer("Upper clamp of the desired replicas.", 1, 1000, 100),
            "requireHostSpread": {
                "type": "boolean",
                "default": False,
                "description": "Never put two replicas on one node (hard constraint); "
                "by default spreading over nodes is preferred, not required.",
            },
        },
        ("spec", "scaling"),
    )


def _router() -> dict[str, Any]:
    return _object(
        "The routing sidecar in every pod.",
        {
            "policy": {
                "type": "string",
                "enum": list(ROUTER_POLICIES),
                "default": "cache_aware",
                "description": "How the router picks a replica.",
            },
            "weights": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    name: {"type": "number", "minimum": 0, "maximum": 1000} for name in ROUTER_WEIGHT_KEYS
                },
                "description": "cache_aware knobs passed as --weights k=v,... (keys: "
                + ", ".join(ROUTER_WEIGHT_KEYS)
                + ").",
            },
        },
        ("spec", "router"),
    )


def _tenancy() -> dict[str, Any]:
    toleration = {
        "type": "object",
        "properties": {
            "key": {"type": "string", "maxLength": 317},
            "operator": {"type": "string", "enum": ["Exists", "Equal"]},
            "value": {"type": "string", "maxLength": 63},
            "effect": {"type": "string", "enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]},
            "tolerationSeconds": {"type": "integer", "format": "int64", "minimum": 0},
        },
    }
    return _object(
        "Where the replicas may run and how they share a cluster with other tenants.",
        {
            "priorityClassName": {"type": "string", "maxLength": 253, "pattern": DNS_LABEL_PATTERN},
            "nodeSelector": {
                "type": "object",
                "additionalProperties": {"type": "string", "maxLength": 63},
                "maxProperties": 16,
            },
            "tolerations": {"type": "array", "maxItems": 16, "items": toleration},
            "imagePullSecrets": {
                "type": "array",
                "maxItems": 8,
                "items": {"type": "string", "maxLength": 253, "pattern": DNS_LABEL_PATTERN},
            },
        },
        ("spec", "tenancy"),
        default_empty=False,
    )


def spec_schema() -> dict[str, Any]:
    schema = _object(
        "Desired state of one served model.",
        {
            "model": _model(),
            "engine": _engine(),
            "resources": _resources(),
            "slo": _slo(),
            "scaling": _scaling(),
            "router": _router(),
            "tenancy": _tenancy(),
        },
        ("spec",),
        required=("model",),
        default_empty=False,
    )
    return schema


def _condition() -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["type", "status"],
        "properties": {
            "type": {"type": "string", "enum": list(CONDITION_TYPES)},
            "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "reason": {"type": "string", "maxLength": 1024},
            "message": {"type": "string", "maxLength": 32768},
            "lastTransitionTime": {"type": "string", "format": "date-time"},
            "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0},
        },
    }


def status_schema() -> dict[str, Any]:
    count = {"type": "integer", "format": "int32", "minimum": 0}
    seconds = {"type": "number", "minimum": 0}
    return {
        "type": "object",
        "description": "Observed state, written by the operator.",
        "properties": {
            "phase": {"type": "string", "enum": list(PHASES)},
            "conditions": {
                "type": "array",
                "items": _condition(),
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
            "replicas": count,
            "readyReplicas": count,
            "desiredReplicas": count,
            "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0},
            "endpoint": {"type": "string"},
            "sizing": {
                "type": "object",
                "description": "Inputs and result of the N+1 replica sizing.",
                "properties": {
                    "mode": {"type": "string", "enum": ["Replicas", "Rate"]},
                    "replicas": count,
                    "targetRequestsPerSecond": {"type": "number"},
                    "perReplicaGoodput": {"type": "number"},
                    "headroom": {"type": "number"},
                    "spare": count,
                    "minReplicas": count,
                    "maxReplicas": count,
                    "serving": count,
                    "unclamped": count,
                    "desiredReplicas": count,
                    "formula": {"type": "string"},
                },
            },
            "engines": {
                "type": "object",
                "description": "Replicas by warm-up stage.",
                "properties": {
                    "pending": count,
                    "loading": count,
                    "warmingUp": count,
                    "ready": count,
                    "failing": count,
                },
            },
            "coldStart": {
                "type": "object",
                "description": "Pod creation to Ready, for recently started replicas.",
                "properties": {
                    "samples": count,
                    "lastSeconds": seconds,
                    "maxSeconds": seconds,
                    "recent": {
                        "type": "array",
                        "maxItems": 5,
                        "items": {
                            "type": "object",
                            "properties": {
                                "pod": {"type": "string"},
                                "seconds": seconds,
                                "readyAt": {"type": "string", "format": "date-time"},
                            },
                        },
                    },
                },
            },
        },
    }
