"""The one schema source of the InferenceService API (OpenAPI v3, structural, as a CRD wants it).

The CRD in ``crds/`` and in the Helm chart is generated from this module (see ``crd.py``); the operator
validates and defaults specs against the same dicts (see ``spec.py``). Bounds, enums and defaults live
here; cross-field rules live in ``crd_rules.py`` and are attached below as ``x-kubernetes-validations``.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any

from kvpilot.operator.crd_rules import CPU_KV_CACHE_MEMORY, rules_for
from kvpilot.operator.model_source import DEFAULT_HF_ENDPOINT, DEFAULT_S3_REGION, SOURCE_PATTERN
from kvpilot.router.config import POLICIES, ScoringWeights

#: the router's cost-term knobs, straight from its config (one source of truth for the CRD and the router)
ROUTER_WEIGHT_KEYS = tuple(f.name for f in fields(ScoringWeights))
#: what each knob does (the router's defaults are added from ScoringWeights; a test keeps the keys equal)
ROUTER_WEIGHT_DESCRIPTIONS = {
    "queue": "Multiplier on the prefill tokens already queued at a replica (work ahead of the request).",
    "prefill": "Multiplier on the request's own prompt tokens the replica does not hold in its prefix cache "
    "(the work a cache hit saves).",
    "decode": "Multiplier on one decode step of the replica's running batch, which the first token waits "
    "for.",
    "balance": "Hot-spot guard: a replica whose outstanding requests reach ceil((1 + balance) x (all "
    "outstanding + 1) / replicas) takes no new request while another can.",
    "balance_floor": "The hot-spot guard leaves a replica with fewer outstanding requests than this alone "
    "(low load never breaks affinity).",
    "tie_ms": "Costs within this many milliseconds of the best tie; the rendezvous hash of the request's "
    "first block breaks the tie, so independent routers pick the same replica.",
}

# Kubernetes' own resource.Quantity grammar, without a sign: memory and KV sizes are never negative.
QUANTITY_PATTERN = (
    r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"  # the number
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"  # its suffix, if any
)
# Model sources: a bundled name, an absolute path inside the image or on a mounted volume,
# pvc://<claim>[/<path in the claim>] (mounted read-only), or a URL the init container fetches
# (operator/model_source.py says each form).
MODEL_SOURCE_PATTERN = SOURCE_PATTERN
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
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
                "description": "smollm2-135m or tiny-random (bundled); an absolute path in the image or on "
                "a volume; pvc://<claim>/<path> (mounted read-only at /models/<claim>; a claim shared by "
                "replicas on several nodes needs the ReadOnlyMany access mode); or fetched into the pod's "
                "model cache by an init container before the engine starts: https://.../<file>.gguf (or "
                "http:// for an in-cluster mirror), s3://<bucket>/<key>.gguf (from model.endpoint), "
                "hf://<org>/<name>[@<revision>] (a Hugging Face repository with config.json, "
                "tokenizer.json and safetensors) or hf://<org>/<name>[@<revision>]/<path>.gguf, from "
                f"model.endpoint ({DEFAULT_HF_ENDPOINT} when unset).",
            },
            "sha256": {
                "type": "string",
                "pattern": "^[0-9a-f]{64}$",
                "description": "Lower-case hex SHA-256 of a fetched single-file source: the download is "
                "checked before the engine starts, and a mismatch fails the replica (condition reason "
                "ModelFetchFailed) naming both digests. Pin an hf:// repository by its revision instead.",
            },
            "sizeLimit": _quantity(
                "The most a fetched source may download (all its files together; default 10Gi): a larger "
                "one is refused before or while it streams, failing the replica (ModelFetchFailed). Also "
                "the size of the volume the files are fetched into."
            ),
            "cacheSize": _quantity(
                "Size of each replica's scratch volume (an emptyDir: weights converted from GGUF, "
                "tokenizer and kernel caches), set as its sizeLimit and as the engine's ephemeral-storage "
                "request (with sizeLimit for fetched sources). Default: what a bundled model's conversion "
                "needs, else 10Gi; a GGUF converted to float32 takes about 8 times its 4-bit size."
            ),
            "endpoint": {
                "type": "string",
                "pattern": r"^https?://[^\s/]+(/\S*)?$",
                "maxLength": 512,
                "description": "Where s3:// and hf:// sources are fetched from: the S3-compatible endpoint "
                f"(required for s3://, path-style requests) or the Hugging Face endpoint or mirror "
                f"(HF_ENDPOINT-style; {DEFAULT_HF_ENDPOINT} when unset).",
            },
            "region": {
                "type": "string",
                "pattern": "^[a-z0-9-]+$",
                "maxLength": 64,
                "description": f"Region s3:// requests are signed for (AWS Signature V4; {DEFAULT_S3_REGION} "
                "when unset).",
            },
            "credentialsSecret": {
                "type": "string",
                "pattern": DNS_SUBDOMAIN_PATTERN,
                "maxLength": 253,
                "description": "A Secret in the InferenceService's namespace with the fetch credentials, "
                "read only by the init container: keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and "
                "AWS_SESSION_TOKEN) for s3:// (requests are then signed), key token for https://, http:// "
                "and hf:// (sent as Authorization: Bearer). Without it, requests are anonymous.",
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
                "GPU pods without kvCacheMemory: the fraction of the GPU's memory the engine may use for "
                "weights, activations and the KV cache together; ignored on CPU and when kvCacheMemory "
                "is set.",
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


def _router_weight(name: str) -> dict[str, Any]:
    default = next(f.default for f in fields(ScoringWeights) if f.name == name)
    unset = "" if default is MISSING else f" Unset: the router's {default:g}."
    return {
        "type": "number",
        "minimum": 0,
        "maximum": 1000,
        "description": ROUTER_WEIGHT_DESCRIPTIONS[name] + unset,
    }


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
                "properties": {name: _router_weight(name) for name in ROUTER_WEIGHT_KEYS},
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
            "key": {
                "type": "string",
                "maxLength": 317,
                "description": "Taint key the toleration matches; empty with operator Exists matches every "
                "taint.",
            },
            "operator": {
                "type": "string",
                "enum": ["Exists", "Equal"],
                "description": "Exists: any value of the key; Equal (Kubernetes' default): the value below.",
            },
            "value": {
                "type": "string",
                "maxLength": 63,
                "description": "Taint value to match with operator Equal.",
            },
            "effect": {
                "type": "string",
                "enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"],
                "description": "Taint effect to match; empty matches every effect.",
            },
            "tolerationSeconds": {
                "type": "integer",
                "format": "int64",
                "minimum": 0,
                "description": "With effect NoExecute: how long a replica stays on a node after the taint "
                "appears (unset: forever).",
            },
        },
        "description": "A Kubernetes toleration, copied into the replicas' pod spec.",
    }
    return _object(
        "Where the replicas may run and how they share a cluster with other tenants.",
        {
            "priorityClassName": {
                "type": "string",
                "maxLength": 253,
                "pattern": DNS_LABEL_PATTERN,
                "description": "PriorityClass of the replicas' pods (scheduling order and preemption).",
            },
            "nodeSelector": {
                "type": "object",
                "additionalProperties": {"type": "string", "maxLength": 63},
                "maxProperties": 16,
                "description": "Node labels the replicas must run on; resources.gpuType adds "
                "nvidia.com/gpu.product.",
            },
            "tolerations": {
                "type": "array",
                "maxItems": 16,
                "items": toleration,
                "description": "Taints the replicas tolerate; GPU replicas also tolerate nvidia.com/gpu "
                "(NoSchedule).",
            },
            "imagePullSecrets": {
                "type": "array",
                "maxItems": 8,
                "items": {"type": "string", "maxLength": 253, "pattern": DNS_LABEL_PATTERN},
                "description": "Names of Secrets in this namespace for pulling the engine image.",
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
        "description": "One condition, as Kubernetes conditions are written.",
        "required": ["type", "status"],
        "properties": {
            "type": {
                "type": "string",
                "enum": list(CONDITION_TYPES),
                "description": "Ready: phase Ready; Progressing: a rollout phase (Pending, Loading, "
                "WarmingUp); Degraded: phase Degraded or Failed.",
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
                "ReplicasLost, InvalidSpec (Progressing: Idle outside a rollout).",
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


def _count(description: str) -> dict[str, Any]:
    return {"type": "integer", "format": "int32", "minimum": 0, "description": description}


def _seconds(description: str) -> dict[str, Any]:
    return {"type": "number", "minimum": 0, "description": description}


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
                "none serves and a replica fails, the rollout stalled, or the spec is invalid.",
            },
            "conditions": {
                "type": "array",
                "items": _condition(),
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
                "description": "Ready, Progressing and Degraded, one of each.",
            },
            "replicas": _count("Engine pods that exist (any stage)."),
            "readyReplicas": _count("Replicas whose engine is loaded, warmed up and Ready."),
            "desiredReplicas": _count("Replicas the N+1 sizing asks for (serving + spare)."),
            "observedGeneration": {
                "type": "integer",
                "format": "int64",
                "minimum": 0,
                "description": "metadata.generation of the spec this status describes.",
            },
            "endpoint": {
                "type": "string",
                "description": "In-cluster URL of the client Service (the routers); OpenAI paths under /v1.",
            },
            "sizing": {
                "type": "object",
                "description": "Inputs and result of the N+1 replica sizing.",
                "properties": {
                    "mode": {
                        "type": "string",
                        "enum": ["Replicas", "Rate"],
                        "description": "Replicas: from scaling.replicas; Rate: from "
                        "scaling.targetRequestsPerSecond and scaling.perReplicaGoodput.",
                    },
                    "replicas": _count("scaling.replicas (mode Replicas)."),
                    "targetRequestsPerSecond": {
                        "type": "number",
                        "description": "scaling.targetRequestsPerSecond (mode Rate).",
                    },
                    "perReplicaGoodput": {
                        "type": "number",
                        "description": "scaling.perReplicaGoodput (mode Rate).",
                    },
                    "headroom": {"type": "number", "description": "scaling.headroom (mode Rate)."},
                    "spare": _count("scaling.spare."),
                    "minReplicas": _count("scaling.minReplicas."),
                    "maxReplicas": _count("scaling.maxReplicas."),
                    "serving": _count("Replicas that carry the load (N)."),
                    "unclamped": _count("N + spare, before the min/max clamp."),
                    "desiredReplicas": _count("The clamped result."),
                    "formula": {"type": "string", "description": "The arithmetic with its numbers."},
                },
            },
            "engines": {
                "type": "object",
                "description": "Replicas by warm-up stage.",
                "properties": {
                    "pending": _count(
                        "Desired replicas whose engine has not started: no pod yet, not scheduled, "
                        "or the container waiting (e.g. pulling its image)."
                    ),
                    "loading": _count("Engines loading weights and allocating the KV cache."),
                    "warmingUp": _count("Engines running their warm-up passes (and kernel tuning on CUDA)."),
                    "ready": _count("Engines Ready to serve."),
                    "failing": _count(
                        "Pods that will not serve without a change: crash loop, image pull or container "
                        "config errors, a terminated engine or a failed pod."
                    ),
                },
            },
            "coldStart": {
                "type": "object",
                "description": "Pod creation to Ready, for recently started replicas.",
                "properties": {
                    "samples": _count("Replicas measured since the InferenceService was created."),
                    "lastSeconds": _seconds("Cold start of the replica that turned Ready last."),
                    "maxSeconds": _seconds("Longest cold start measured."),
                    "recent": {
                        "type": "array",
                        "maxItems": 5,
                        "description": "The latest replicas to turn Ready, newest first.",
                        "items": {
                            "type": "object",
                            "description": "One replica's cold start.",
                            "properties": {
                                "pod": {"type": "string", "description": "Pod name."},
                                "seconds": _seconds("Pod creation to Ready."),
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
