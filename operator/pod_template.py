"""The pod every replica runs: the engine container, the router sidecar, probes, volumes, placement.

Container command lines, ports and probes follow docs/architecture.md#operator-engine-and-router exactly;
probe timing comes from ``startup.py``. The router in each pod watches the EndpointSlices of
``<name>-engines``, so any pod can route to the best engine in the whole InferenceService.
"""

from __future__ import annotations

import json
from typing import Any

from kvpilot.operator import api_names
from kvpilot.operator.model_delivery import FETCH_VOLUME, fetch_init_container, model_volumes, storage_request
from kvpilot.operator.spec import FETCH_MOUNT, MODELS_MOUNT, InferenceService
from kvpilot.operator.startup import PROBE_PERIOD_SECONDS, startup_budget

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
ROUTER_CPU = "100m"
ROUTER_MEMORY = "256Mi"
# The router imports its HTTP and Kubernetes clients and loads the model's tokenizer before it listens:
# seconds of CPU, which on a busy node with its small CPU request can outlast the liveness probe's
# 3 × 10 s. Its startup probe holds liveness off for up to 2 minutes, checking every 5 s so that a
# router that is up is not kept waiting (readiness also waits for it).
ROUTER_STARTUP_PERIOD_SECONDS = 5
ROUTER_STARTUP_FAILURE_THRESHOLD = 24
# Enough for in-flight requests to finish after the engine stops taking new ones (phase "draining").
TERMINATION_GRACE_SECONDS = 120
RUN_AS_USER = 10001  # the image's non-root user
# Tensor-parallel ranks (several GPUs per replica) exchange tensors through /dev/shm (NCCL's shared-memory
# transport, torch.multiprocessing); the container runtime's default is 64 MiB, so it is a memory-backed
# emptyDir, counted against the pod's memory limit.
SHM_VOLUME = "dshm"
# NCCL in a tensor-parallel pod: warnings in the log; an error or a timed-out collective aborts the
# communicator, so the engine fails (and the pod restarts) instead of hanging.
_NCCL_ENV = [
    {"name": "NCCL_DEBUG", "value": "WARN"},
    {"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "1"},
]


def _model_mounts(isvc: InferenceService) -> list[dict[str, Any]]:
    """The writable scratch volume, and read-only the model's PVC or the fetched model cache."""
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}]
    if isvc.spec.model.pvc_claim:
        mounts.append(
            {"name": "model", "mountPath": f"{MODELS_MOUNT}/{isvc.spec.model.pvc_claim}", "readOnly": True}
        )
    if isvc.spec.model.fetch is not None:
        mounts.append({"name": FETCH_VOLUME, "mountPath": FETCH_MOUNT, "readOnly": True})
    return mounts


# Caches (converted weights, extracted tokenizers, Triton kernels) go to the writable emptyDir; the root
# filesystem stays read-only.
_CACHE_ENV = [
    {"name": "HOME", "value": "/tmp"},
    {"name": "XDG_CACHE_HOME", "value": "/tmp/cache"},
    {"name": "TRITON_CACHE_DIR", "value": "/tmp/triton"},
]


def router_token_secret_name(isvc: InferenceService) -> str:
    return f"{isvc.name}{api_names.ROUTER_TOKEN_SECRET_SUFFIX}"


def _router_token_env(isvc: InferenceService) -> dict[str, Any]:
    """Both containers read the shared router token from the Secret the operator creates (children.py):
    the router sends it with each proxied request, the engine trusts ``x-tenant`` only when it matches."""
    return {
        "name": api_names.ROUTER_TOKEN_ENV,
        "valueFrom": {
            "secretKeyRef": {"name": router_token_secret_name(isvc), "key": api_names.ROUTER_TOKEN_KEY}
        },
    }


def engine_args(isvc: InferenceService) -> list[str]:
    spec = isvc.spec
    engine = spec.engine
    args = [
        "--model",
        spec.model.engine_path,
        "--port",
        str(api_names.ENGINE_PORT),
        "--served-model-name",
        spec.model.served_name,
        "--dtype",
        spec.model.dtype,
        "--block-size",
        str(engine.block_size),
        "--max-num-seqs",
        str(engine.max_num_seqs),
        "--max-num-batched-tokens",
        str(engine.max_num_batched_tokens),
        "--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching",
        "--enable-chunked-prefill" if engine.enable_chunked_prefill else "--no-enable-chunked-prefill",
    ]
    kv_bytes = spec.kv_cache_memory_bytes
    if kv_bytes is None:
        # GPU without a fixed size: the engine sizes its cache after loading weights and profiling a pass.
        args += ["--gpu-memory-utilization", f"{engine.gpu_memory_utilization:g}"]
    else:
        args += ["--kv-cache-memory-bytes", str(kv_bytes)]
    args += ["--slo-ttft", f"{spec.slo.ttft_seconds:g}", "--slo-tpot", f"{spec.slo.tpot_seconds:g}"]
    if engine.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", engine.kv_cache_dtype]
    if spec.model.quantization != "auto":
        args += ["--quantization", spec.model.quantization]
    if engine.activation_quantization != "auto":
        args += ["--activation-quantization", engine.activation_quantization]
    if engine.speculative is not None:
        args += ["--speculative-config", json.dumps(dict(engine.speculative), sort_keys=True)]
    if spec.resources.gpus > 1:  # one rank per GPU (docs/architecture.md#tensor-parallelism)
        args += ["--tensor-parallel-size", str(spec.resources.gpus)]
    return args + list(engine.extra_args)


def router_args(isvc: InferenceService) -> list[str]:
    args = [
        # the engine's model spec: the router tokenizes prompts exactly as the engine does
        "--model",
        isvc.spec.model.engine_path,
        "--port",
        str(api_names.ROUTER_PORT),
        "--endpointslices",
        f"{isvc.name}-engines",
        "--namespace",
        isvc.namespace,
        "--policy",
        isvc.spec.router.policy,
    ]
    if isvc.spec.router.weights:
        args += ["--weights", ",".join(f"{key}={value:g}" for key, value in isvc.spec.router.weights)]
    return args


def _http_probe(path: str, port: str, *, period: int, failures: int, timeout: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def _security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _engine_container(isvc: InferenceService, image: str) -> dict[str, Any]:
    spec = isvc.spec
    budget = startup_budget(spec.model)
    # The scratch volume (and the fetched model) count against the node's ephemeral storage: request them,
    # so the scheduler places the pod where they fit.
    requests: dict[str, str] = {
        "cpu": spec.resources.cpu,
        "memory": spec.resources.memory,
        "ephemeral-storage": storage_request(spec.model),
    }
    limits: dict[str, str] = {"memory": spec.resources.memory}
    if spec.resources.gpus:
        requests[GPU_RESOURCE] = str(spec.resources.gpus)
        limits[GPU_RESOURCE] = str(spec.resources.gpus)
    parallel = spec.resources.gpus > 1
    tensor_parallel_env = [dict(e) for e in _NCCL_ENV] if parallel else []
    shm_mount = [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}] if parallel else []
    return {
        "name": api_names.ENGINE_CONTAINER,
        "image": image,
        "command": ["kvpilot", "serve"],
        "args": engine_args(isvc),
        "ports": [{"name": "http", "containerPort": api_names.ENGINE_PORT, "protocol": "TCP"}],
        "env": [*(dict(e) for e in _CACHE_ENV), *tensor_parallel_env, _router_token_env(isvc)],
        "resources": {"requests": requests, "limits": limits},
        "startupProbe": _http_probe(
            "/health", "http", period=PROBE_PERIOD_SECONDS, failures=budget.probe_failure_threshold, timeout=5
        ),
        "livenessProbe": _http_probe("/health", "http", period=10, failures=3, timeout=5),
        # /ready turns 200 only after warm-up, so a cold replica never gets traffic.
        "readinessProbe": _http_probe("/ready", "http", period=5, failures=2, timeout=3),
        "volumeMounts": [*_model_mounts(isvc), *shm_mount],
        "securityContext": _security_context(),
    }


def _router_container(isvc: InferenceService, image: str) -> dict[str, Any]:
    return {
        "name": api_names.ROUTER_CONTAINER,
        "image": image,
        "command": ["kvpilot", "router"],
        "args": router_args(isvc),
        # the router reads the model's tokenizer (from the same source as the engine) into its cache
        "env": [*(dict(e) for e in _CACHE_ENV[:2]), _router_token_env(isvc)],
        "volumeMounts": _model_mounts(isvc),
        "ports": [{"name": "http-router", "containerPort": api_names.ROUTER_PORT, "protocol": "TCP"}],
        "resources": {
            "requests": {"cpu": ROUTER_CPU, "memory": ROUTER_MEMORY},
            "limits": {"memory": ROUTER_MEMORY},
        },
        "startupProbe": _http_probe(
            "/health",
            "http-router",
            period=ROUTER_STARTUP_PERIOD_SECONDS,
            failures=ROUTER_STARTUP_FAILURE_THRESHOLD,
            timeout=3,
        ),
        "livenessProbe": _http_probe("/health", "http-router", period=10, failures=3, timeout=3),
        # Ready when at least one engine of the service is ready (the router's own /ready rule).
        "readinessProbe": _http_probe("/ready", "http-router", period=5, failures=2, timeout=3),
        "securityContext": _security_context(),
    }


def _spread(isvc: InferenceService, selector: dict[str, str]) -> list[dict[str, Any]]:
    # Zones are preferred (a small cluster may have one); hosts are hard only when asked, because on
    # a one-node dev cluster a hard host spread would leave the spare replica Pending forever.
    host_policy = "DoNotSchedule" if isvc.spec.scaling.require_host_spread else "ScheduleAnyway"
    return [
        {
            "maxSkew": 1,
            "topologyKey": key,
            "whenUnsatisfiable": policy,
            "labelSelector": {"matchLabels": dict(selector)},
            "matchLabelKeys": ["pod-template-hash"],
        }
        for key, policy in (
            ("topology.kubernetes.io/zone", "ScheduleAnyway"),
            ("kubernetes.io/hostname", host_policy),
        )
    ]


def pod_template(
    isvc: InferenceService, labels: dict[str, str], selector: dict[str, str], default_image: str
) -> dict[str, Any]:
    spec = isvc.spec
    image = spec.engine.image or default_image
    volumes = model_volumes(spec.model)
    if spec.resources.gpus > 1:
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}})
    pod_spec: dict[str, Any] = {
        "serviceAccountName": f"{isvc.name}-router",
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_engine_container(isvc, image), _router_container(isvc, image)],
        "volumes": volumes,
        "topologySpreadConstraints": _spread(isvc, selector),
    }
    node_selector = dict(spec.tenancy.node_selector)
    if spec.resources.gpu_type:
        node_selector[GPU_PRODUCT_LABEL] = spec.resources.gpu_type
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    tolerations = [dict(t) for t in spec.tenancy.tolerations]
    if spec.resources.gpus:
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if spec.tenancy.priority_class_name:
        pod_spec["priorityClassName"] = spec.tenancy.priority_class_name
    if spec.model.fetch is not None:
        pod_spec["initContainers"] = [fetch_init_container(spec.model, image, _security_context())]
    if spec.tenancy.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in spec.tenancy.image_pull_secrets]
    return {"metadata": {"labels": dict(labels)}, "spec": pod_spec}
