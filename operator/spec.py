"""Typed view of an InferenceService: the dataclasses every builder and the sizing read from.

``InferenceService.from_manifest`` is the boundary: it validates (``spec_validation``) and then maps the
camelCase spec onto frozen dataclasses, so nothing downstream handles raw dicts or missing keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kubernetes.utils import parse_quantity

from kvpilot.operator import api_names
from kvpilot.operator.crd_rules import CPU_KV_CACHE_MEMORY
from kvpilot.operator.model_source import (
    DEFAULT_S3_REGION,
    FETCH_MOUNT,
    MODELS_MOUNT,
    Fetch,
    engine_path,
    parse_fetch,
    pvc_claim,
)
from kvpilot.operator.spec_validation import SpecError, validated_spec

DEFAULT_FETCH_SIZE_LIMIT = "10Gi"  # the most a fetched source may download, when model.sizeLimit is unset


@dataclass(frozen=True)
class ModelSpec:
    source: str
    served_name: str
    dtype: str = "auto"
    #: the engine's ``--quantization``
    quantization: str = "auto"
    startup_timeout_seconds: int | None = None
    sha256: str | None = None  # of a fetched single-file source
    size_limit: str = DEFAULT_FETCH_SIZE_LIMIT  # a fetched source: the most bytes downloaded
    cache_size: str | None = None  # the scratch volume's size; None: model_size.scratch_bytes decides
    endpoint: str | None = None  # s3: the S3-compatible endpoint; hf: the mirror (default huggingface.co)
    region: str = DEFAULT_S3_REGION  # s3: the region requests are signed for
    credentials_secret: str | None = None  # a Secret in the namespace (keys: see pod_template)

    @property
    def pvc_claim(self) -> str | None:
        return pvc_claim(self.source)

    @property
    def fetch(self) -> Fetch | None:
        """The download the init container makes, or None when the pod has the model already."""
        return parse_fetch(self.source)

    @property
    def engine_path(self) -> str:
        """What the engine gets as --model: the name or path, a PVC or a fetched file as its mount path."""
        return engine_path(self.source)


@dataclass(frozen=True)
class EngineSpec:
    image: str | None = None
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    #: the KV budget as a quantity (``2Gi``); None = sized from the GPU, or the CPU default on CPU
    kv_cache_memory: str | None = None
    #: fraction of GPU memory the engine may use; sizes the KV cache of GPU pods without kv_cache_memory
    gpu_memory_utilization: float = 0.9
    #: the engine's ``--kv-cache-dtype``: auto, fp8 or int8
    kv_cache_dtype: str = "auto"
    #: the engine's ``--activation-quantization``: auto, none, int8 or fp8
    activation_quantization: str = "auto"
    #: the engine's ``--speculative-config`` (vLLM's keys), or None = off
    speculative: tuple[tuple[str, object], ...] | None = None
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class ResourcesSpec:
    gpus: int = 0
    gpu_type: str | None = None
    cpu: str = "2"
    memory: str = "8Gi"


@dataclass(frozen=True)
class SLOSpec:
    ttft_seconds: float = 2.0
    tpot_seconds: float = 0.1


@dataclass(frozen=True)
class ScalingSpec:
    replicas: int | None = None
    target_requests_per_second: float | None = None
    per_replica_goodput: float | None = None
    headroom: float = 0.2
    spare: int = 1
    min_replicas: int = 1
    max_replicas: int = 100
    require_host_spread: bool = False


@dataclass(frozen=True)
class AutoscalingSpec:
    """spec.autoscaling (docs/architecture.md#autoscaling); the CRD descriptions say each field."""

    mode: str = "off"  # off | operator | external
    prometheus_url: str | None = None  # None: scrape the engines' /metrics
    interval_seconds: int = 15
    rate_window_seconds: int = 60
    scale_up_stabilization_seconds: int = 0
    scale_down_stabilization_seconds: int = 300
    cooldown_seconds: int = 60
    min_goodput_samples: int = 3
    idle_timeout_seconds: int = 300  # minReplicas 0: no arrivals this long -> zero replicas
    activator_hold_seconds: int = 300  # at zero, how long the activator holds a request


@dataclass(frozen=True)
class RouterSpec:
    policy: str = "cache_aware"
    weights: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class TenancySpec:
    priority_class_name: str | None = None
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[dict[str, Any], ...] = ()
    image_pull_secrets: tuple[str, ...] = ()


@dataclass(frozen=True)
class InferenceServiceSpec:
    model: ModelSpec
    engine: EngineSpec = field(default_factory=EngineSpec)
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    slo: SLOSpec = field(default_factory=SLOSpec)
    scaling: ScalingSpec = field(default_factory=ScalingSpec)
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    #: spec.replicas, the scale subresource's count (followed in autoscaling.mode external only)
    replicas: int | None = None
    router: RouterSpec = field(default_factory=RouterSpec)
    tenancy: TenancySpec = field(default_factory=TenancySpec)

    @property
    def scales_to_zero(self) -> bool:
        """autoscaling.mode operator with scaling.minReplicas 0: idle means zero replicas, and the
        activator answers the client Service meanwhile (docs/architecture.md#scale-to-zero)."""
        return self.autoscaling.mode == "operator" and self.scaling.min_replicas == 0

    @property
    def kv_cache_memory_bytes(self) -> int | None:
        """The fixed KV budget the engine gets, or None when a GPU pod sizes it from
        gpu_memory_utilization."""
        quantity = self.engine.kv_cache_memory
        if quantity is None and self.resources.gpus == 0:
            quantity = CPU_KV_CACHE_MEMORY
        return None if quantity is None else int(parse_quantity(quantity))

    @classmethod
    def from_dict(cls, raw_spec: Any, name: str) -> InferenceServiceSpec:
        spec = validated_spec(raw_spec)
        model, engine, res, slo = spec["model"], spec["engine"], spec["resources"], spec["slo"]
        scaling, router, tenancy = spec["scaling"], spec["router"], spec.get("tenancy", {})
        autoscaling = spec["autoscaling"]
        return cls(
            model=ModelSpec(
                source=model["source"],
                served_name=model.get("servedName", name),
                dtype=model["dtype"],
                quantization=model["quantization"],
                startup_timeout_seconds=model.get("startupTimeoutSeconds"),
                sha256=model.get("sha256"),
                size_limit=model.get("sizeLimit", DEFAULT_FETCH_SIZE_LIMIT),
                cache_size=model.get("cacheSize"),
                endpoint=model.get("endpoint"),
                region=model.get("region", DEFAULT_S3_REGION),
                credentials_secret=model.get("credentialsSecret"),
            ),
            engine=EngineSpec(
                image=engine.get("image"),
                block_size=engine["blockSize"],
                max_num_seqs=engine["maxNumSeqs"],
                max_num_batched_tokens=engine["maxNumBatchedTokens"],
                enable_prefix_caching=engine["enablePrefixCaching"],
                enable_chunked_prefill=engine["enableChunkedPrefill"],
                kv_cache_memory=engine.get("kvCacheMemory"),
                gpu_memory_utilization=float(engine["gpuMemoryUtilization"]),
                kv_cache_dtype=engine["kvCacheDtype"],
                activation_quantization=engine["activationQuantization"],
                speculative=_speculative_config(engine.get("speculative")),
                extra_args=tuple(engine["extraArgs"]),
            ),
            resources=ResourcesSpec(
                gpus=res["gpus"], gpu_type=res.get("gpuType"), cpu=res["cpu"], memory=res["memory"]
            ),
            slo=SLOSpec(ttft_seconds=float(slo["ttftSeconds"]), tpot_seconds=float(slo["tpotSeconds"])),
            scaling=ScalingSpec(
                replicas=scaling.get("replicas"),
                target_requests_per_second=_optional_float(scaling.get("targetRequestsPerSecond")),
                per_replica_goodput=_optional_float(scaling.get("perReplicaGoodput")),
                headroom=float(scaling["headroom"]),
                spare=scaling["spare"],
                min_replicas=scaling["minReplicas"],
                max_replicas=scaling["maxReplicas"],
                require_host_spread=scaling["requireHostSpread"],
            ),
            autoscaling=AutoscalingSpec(
                mode=autoscaling["mode"],
                prometheus_url=autoscaling.get("prometheusUrl"),
                interval_seconds=autoscaling["intervalSeconds"],
                rate_window_seconds=autoscaling["rateWindowSeconds"],
                scale_up_stabilization_seconds=autoscaling["scaleUpStabilizationSeconds"],
                scale_down_stabilization_seconds=autoscaling["scaleDownStabilizationSeconds"],
                cooldown_seconds=autoscaling["cooldownSeconds"],
                min_goodput_samples=autoscaling["minGoodputSamples"],
                idle_timeout_seconds=autoscaling["idleTimeoutSeconds"],
                activator_hold_seconds=autoscaling["activatorHoldSeconds"],
            ),
            replicas=spec.get("replicas"),
            router=RouterSpec(
                policy=router["policy"],
                weights=tuple(sorted((k, float(v)) for k, v in router.get("weights", {}).items())),
            ),
            tenancy=TenancySpec(
                priority_class_name=tenancy.get("priorityClassName"),
                node_selector=tuple(sorted(tenancy.get("nodeSelector", {}).items())),
                tolerations=tuple(tenancy.get("tolerations", [])),
                image_pull_secrets=tuple(tenancy.get("imagePullSecrets", [])),
            ),
        )


_SPECULATIVE_KEYS = {
    "method": "method",
    "numSpeculativeTokens": "num_speculative_tokens",
    "promptLookupMin": "prompt_lookup_min",
    "promptLookupMax": "prompt_lookup_max",
    "draftModel": "model",
    "disableByBatchSize": "disable_by_batch_size",
}


def _speculative_config(spec: dict[str, Any] | None) -> tuple[tuple[str, object], ...] | None:
    """``engine.speculative`` in the engine's key names; prompt-lookup keys only for ``ngram``."""
    if spec is None:
        return None
    lookup = ("promptLookupMin", "promptLookupMax")
    return tuple(
        (_SPECULATIVE_KEYS[k], v)
        for k, v in spec.items()
        if k in _SPECULATIVE_KEYS and (spec["method"] == "ngram" or k not in lookup)
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class InferenceService:
    """The identity of the custom resource plus its typed spec."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: InferenceServiceSpec

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any], default_namespace: str = "default") -> InferenceService:
        """Validate a whole object (as read from YAML or the API) into its typed form."""
        if manifest.get("apiVersion") != api_names.API_VERSION or manifest.get("kind") != api_names.KIND:
            raise SpecError(
                "kind",
                f"expected apiVersion {api_names.API_VERSION} and kind {api_names.KIND}, "
                f"got {manifest.get('apiVersion')!r} {manifest.get('kind')!r}",
            )
        metadata = manifest.get("metadata") or {}
        name = metadata.get("name")
        if not name:
            raise SpecError("metadata.name", "Required value")
        return cls(
            name=name,
            namespace=metadata.get("namespace") or default_namespace,
            uid=metadata.get("uid", ""),
            generation=int(metadata.get("generation", 0)),
            spec=InferenceServiceSpec.from_dict(manifest.get("spec"), name),
        )


__all__ = ["FETCH_MOUNT", "MODELS_MOUNT", "InferenceService", "InferenceServiceSpec", "SpecError"]
