"""The one schema source of the InferenceService API (OpenAPI v3, structural, as a CRD wants it).

The CRD in ``crds/`` and in the Helm chart is generated from ``spec_schema`` and ``status_schema`` (see
``crd.py``); the operator validates and defaults specs against the same dicts (see ``spec.py``). Bounds,
enums and defaults live in the block modules (``schema_model``, ``schema_scaling`` and the engine,
resources, SLO, router and tenancy blocks here; ``status_schema`` for the status); cross-field rules live
in ``crd_rules.py`` and are attached by ``schema_types.obj`` as ``x-kubernetes-validations``.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any

from kvpilot.operator.crd_rules import CPU_KV_CACHE_MEMORY
from kvpilot.operator.schema_model import model_schema
from kvpilot.operator.schema_scaling import autoscaling_schema, replicas_schema, scaling_schema
from kvpilot.operator.schema_types import (
    DNS_LABEL_PATTERN,
    QUANTITY_PATTERN,
    integer,
    number,
    obj,
    quantity,
)
from kvpilot.operator.status_schema import PHASES, status_schema
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

ROUTER_POLICIES = POLICIES
BLOCK_SIZES = (8, 16, 32, 64, 128)
#: the engine's kv_cache_dtype values (engine/config.py's KV_CACHE_DTYPES; a test keeps them equal)
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
#: the engine's activation_quantization values (ACTIVATION_QUANTIZATIONS; a test keeps them equal)
ACTIVATION_QUANTIZATIONS = ("auto", "none", "int8", "fp8")
# A replica's GPUs are one node's, joined by tensor parallelism (docs/architecture.md#tensor-parallelism);
# eight is the common node. Spanning nodes needs pipeline parallelism, which does not exist yet.
MAX_GPUS_PER_REPLICA = 8


def _engine() -> dict[str, Any]:
    return obj(
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
            "kvCacheDtype": {
                "type": "string",
                "enum": list(KV_CACHE_DTYPES),
                "default": "auto",
                "description": "What the KV cache stores (the engine's --kv-cache-dtype): auto = the model's "
                "dtype; fp8 (e4m3) or int8 store one byte per element and a scale per token and KV head, so "
                "about 3.8x (float32) or 1.9x (bfloat16) the blocks in the same memory, at a measured "
                "accuracy cost (docs/architecture.md#kv-cache-dtype).",
            },
            "activationQuantization": {
                "type": "string",
                "enum": list(ACTIVATION_QUANTIZATIONS),
                "default": "auto",
                "description": "Activations of the quantized GEMMs (the engine's --activation-quantization): "
                "auto = int8 for gguf/int8 weights on CPUs with AVX-512 VNNI or AVX2 (llama.cpp's scheme, "
                "1.4-2x faster), else none; fp8 = W8A8 for fp8 weights on GPUs; none keeps the exact "
                "products (docs/architecture.md#quantized-weights).",
            },
            "maxNumSeqs": integer("Most sequences in one scheduler step.", 1, 4096, 64),
            "maxNumBatchedTokens": integer("Token budget of one scheduler step.", 16, 1048576, 2048),
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
            "kvCacheMemory": quantity(
                "Memory reserved for the KV cache (e.g. 2Gi). Unset: on GPU the engine sizes the cache from "
                f"gpuMemoryUtilization after loading the weights; on CPU it gets {CPU_KV_CACHE_MEMORY}."
            ),
            "gpuMemoryUtilization": number(
                "GPU pods without kvCacheMemory: the fraction of the GPU's memory the engine may use for "
                "weights, activations and the KV cache together; ignored on CPU and when kvCacheMemory "
                "is set.",
                0,
                1,
                exclusive_minimum=True,
                default=0.9,
            ),
            "speculative": _speculative(),
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


def _speculative() -> dict[str, Any]:
    return obj(
        "Speculative decoding (the engine's --speculative-config, vLLM's keys): a cheap proposer drafts "
        "tokens and the model checks them in one forward; outputs are unchanged. Unset: off.",
        {
            "method": {
                "type": "string",
                "enum": ["ngram", "draft_model"],
                "description": "ngram: prompt lookup (pays on text that quotes or edits its prompt); "
                "draft_model: a smaller model with the same tokenizer (draftModel).",
            },
            "numSpeculativeTokens": integer("Tokens drafted per step.", 1, 16),
            "promptLookupMin": integer("ngram: the shortest trailing n-gram that may match.", 1, 64, 1),
            "promptLookupMax": integer("ngram: the longest trailing n-gram, tried first.", 1, 64, 4),
            "draftModel": {
                "type": "string",
                "minLength": 1,
                "maxLength": 512,
                "description": "draft_model: the draft's bundled name or a path inside the pod (e.g. on "
                "the model's volume); it must share the model's tokenizer.",
            },
            "disableByBatchSize": integer(
                "Speculation is off for steps with more decoding sequences than this (the forward is "
                "compute-bound there).",
                1,
                4096,
                4,
            ),
        },
        ("spec", "engine", "speculative"),
        required=("method", "numSpeculativeTokens"),
        default_empty=False,
    )


def _resources() -> dict[str, Any]:
    return obj(
        "Compute per replica.",
        {
            "gpus": integer(
                "GPUs per replica (nvidia.com/gpu), all on one node: more than 1 splits the model over "
                "them (the engine's --tensor-parallel-size); a model of known shape must split that many "
                "ways. Several nodes per replica (pipeline parallelism) are not supported yet.",
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
            "cpu": quantity("CPU request per replica.", "2"),
            "memory": quantity("Memory request and limit per replica.", "8Gi"),
        },
        ("spec", "resources"),
    )


def _slo() -> dict[str, Any]:
    return obj(
        "Latency objectives; a request that meets both counts toward goodput.",
        {
            "ttftSeconds": number(
                "Time to first token objective.", 0, 600, exclusive_minimum=True, default=2.0
            ),
            "tpotSeconds": number(
                "Time per output token objective.", 0, 60, exclusive_minimum=True, default=0.1
            ),
        },
        ("spec", "slo"),
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
    return obj(
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
    return obj(
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
    schema = obj(
        "Desired state of one served model.",
        {
            "model": model_schema(),
            "engine": _engine(),
            "resources": _resources(),
            "slo": _slo(),
            "replicas": replicas_schema(),
            "scaling": scaling_schema(),
            "autoscaling": autoscaling_schema(),
            "router": _router(),
            "tenancy": _tenancy(),
        },
        ("spec",),
        required=("model",),
        default_empty=False,
    )
    return schema


__all__ = ["DNS_LABEL_PATTERN", "PHASES", "QUANTITY_PATTERN", "spec_schema", "status_schema"]
