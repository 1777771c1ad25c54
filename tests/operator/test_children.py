"""The objects the operator applies, with exact values for the contract fields."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvpilot.operator.children import build_children
from kvpilot.operator.spec import InferenceService


def children(spec: dict, uid: str = "u-1") -> dict:
    manifest = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "smol", "namespace": "ml", "uid": uid, "generation": 1},
        "spec": spec,
    }
    built = build_children(InferenceService.from_manifest(manifest), "img:1")
    return {(o["kind"], o["metadata"]["name"]): o for o in built.objects}


def test_engine_and_router_command_lines_follow_the_contracts():
    objects = children(
        {
            "model": {"source": "smollm2-135m", "servedName": "smol-chat"},
            "engine": {"enablePrefixCaching": False, "extraArgs": ["--seed", "7"]},
            "router": {"policy": "least_loaded", "weights": {"prefill": 1.5, "decode": 2}},
        }
    )
    pod = objects[("Deployment", "smol")]["spec"]["template"]["spec"]
    engine, router = pod["containers"]
    assert engine["command"] == ["kvpilot", "serve"]
    assert engine["args"] == [
        "--model",
        "smollm2-135m",
        "--port",
        "8000",
        "--served-model-name",
        "smol-chat",
        "--dtype",
        "auto",
        "--block-size",
        "16",
        "--max-num-seqs",
        "64",
        "--max-num-batched-tokens",
        "2048",
        "--no-enable-prefix-caching",
        "--enable-chunked-prefill",
        "--kv-cache-memory-bytes",
        "1073741824",
        "--slo-ttft",
        "2",
        "--slo-tpot",
        "0.1",
        "--seed",
        "7",
    ]
    assert router["args"] == [
        "--model",
        "smollm2-135m",
        "--port",
        "8080",
        "--endpointslices",
        "smol-engines",
        "--namespace",
        "ml",
        "--policy",
        "least_loaded",
        "--weights",
        "decode=2,prefill=1.5",
    ]
    assert router["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]  # its tokenizer cache
    assert engine["startupProbe"] == {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": 10,
        "failureThreshold": 16,
        "timeoutSeconds": 5,
    }
    assert engine["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    # a router slow to start on a busy node is not killed by its liveness probe before it listens
    assert router["startupProbe"] == {
        "httpGet": {"path": "/health", "port": "http-router"},
        "periodSeconds": 5,
        "failureThreshold": 24,
        "timeoutSeconds": 3,
    }
    assert [c["topologyKey"] for c in pod["topologySpreadConstraints"]] == [
        "topology.kubernetes.io/zone",
        "kubernetes.io/hostname",
    ]


def test_services_budget_and_access():
    objects = children({"model": {"source": "tiny-random"}, "scaling": {"replicas": 3, "spare": 2}})
    engines = objects[("Service", "smol-engines")]["spec"]
    assert (engines["clusterIP"], engines["publishNotReadyAddresses"], engines["ports"][0]["port"]) == (
        "None",
        True,
        8000,
    )
    client = objects[("Service", "smol")]["spec"]["ports"][0]
    assert (client["port"], client["targetPort"]) == (80, "http-router")
    assert objects[("PodDisruptionBudget", "smol")]["spec"]["maxUnavailable"] == 2
    deployment = objects[("Deployment", "smol")]["spec"]
    assert (deployment["replicas"], deployment["strategy"]["rollingUpdate"]) == (
        5,
        {"maxUnavailable": 2, "maxSurge": 0},
    )
    assert objects[("Role", "smol-router")]["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    for obj in objects.values():
        assert obj["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "kvpilot.dev/v1alpha1",
                "kind": "InferenceService",
                "name": "smol",
                "uid": "u-1",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]


def test_no_spare_rolls_by_surging_and_gpu_pvc_pods_get_their_devices_and_volume():
    objects = children(
        {
            "model": {"source": "pvc://weights/llama"},
            "scaling": {"replicas": 2, "spare": 0, "requireHostSpread": True},
            "resources": {"gpus": 1, "gpuType": "H100", "memory": "32Gi"},
        }
    )
    deployment = objects[("Deployment", "smol")]["spec"]
    assert deployment["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    # no spare: the budget still lets one replica go, so node drains are not blocked forever
    assert objects[("PodDisruptionBudget", "smol")]["spec"]["maxUnavailable"] == 1
    pod = deployment["template"]["spec"]
    engine = pod["containers"][0]
    assert engine["resources"]["limits"] == {"memory": "32Gi", "nvidia.com/gpu": "1"}
    assert engine["args"][1] == "/models/weights/llama"
    assert {"name": "model", "mountPath": "/models/weights", "readOnly": True} in engine["volumeMounts"]
    router = pod["containers"][1]  # the router reads the same model's tokenizer from the PVC
    assert router["args"][:2] == ["--model", "/models/weights/llama"]
    assert {"name": "model", "mountPath": "/models/weights", "readOnly": True} in router["volumeMounts"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}
    assert pod["topologySpreadConstraints"][1]["whenUnsatisfiable"] == "DoNotSchedule"
    assert deployment["progressDeadlineSeconds"] == 1800 + 300  # unknown size: the generous default


def engine_args(spec: dict) -> list[str]:
    return children(spec)[("Deployment", "smol")]["spec"]["template"]["spec"]["containers"][0]["args"]


def test_gpu_pods_size_their_kv_cache_from_the_gpu_unless_the_spec_fixes_it():
    gpu = {"model": {"source": "pvc://weights/llama"}, "resources": {"gpus": 1}}
    args = engine_args(gpu)
    assert "--kv-cache-memory-bytes" not in args
    assert args[15:19] == ["--enable-chunked-prefill", "--gpu-memory-utilization", "0.9", "--slo-ttft"]
    tuned = engine_args({**gpu, "engine": {"gpuMemoryUtilization": 0.75}})
    assert tuned[16:18] == ["--gpu-memory-utilization", "0.75"]
    fixed = engine_args({**gpu, "engine": {"kvCacheMemory": "40Gi"}})
    assert fixed[16:18] == ["--kv-cache-memory-bytes", "42949672960"]
    assert "--gpu-memory-utilization" not in fixed


def test_cpu_pods_keep_a_fixed_kv_size():
    assert engine_args({"model": {"source": "tiny-random"}})[16:18] == [
        "--kv-cache-memory-bytes",
        "1073741824",
    ]
    set_size = engine_args(
        {"model": {"source": "tiny-random"}, "engine": {"kvCacheMemory": "512Mi"}, "resources": {"gpus": 0}}
    )
    assert set_size[16:18] == ["--kv-cache-memory-bytes", "536870912"]
    assert "--gpu-memory-utilization" not in set_size


@pytest.mark.parametrize(
    ("quantization", "activations", "gpus"), [("gguf", "none", 0), ("int8", "int8", 0), ("fp8", "fp8", 1)]
)
def test_quantization_and_activations_reach_the_engine_and_auto_adds_no_flag(quantization, activations, gpus):
    from kvpilot.engine.arg_utils import engine_args_from_namespace
    from kvpilot.engine.config import ACTIVATION_QUANTIZATIONS, QUANTIZATIONS
    from kvpilot.engine.server.cli import build_parser
    from kvpilot.operator.crd_schema import ACTIVATION_QUANTIZATIONS as CRD_ACTIVATIONS
    from kvpilot.operator.schema_model import QUANTIZATIONS as CRD_QUANTIZATIONS

    assert (CRD_QUANTIZATIONS, CRD_ACTIVATIONS) == (QUANTIZATIONS, ACTIVATION_QUANTIZATIONS)
    base = {"model": {"source": "tiny-random"}}
    assert not {"--quantization", "--activation-quantization"} & set(engine_args(base))
    spec = {
        "model": {"source": "tiny-random", "quantization": quantization},
        "engine": {"activationQuantization": activations},
        "resources": {"gpus": gpus},
    }
    args = engine_args(spec)
    assert args[args.index("--quantization") + 1] == quantization
    assert args[args.index("--activation-quantization") + 1] == activations
    config = engine_args_from_namespace(build_parser().parse_args(args)).create_config()
    assert (config.model.quantization, config.model.activation_quantization) == (quantization, activations)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_kv_cache_dtype_reaches_the_engine_and_auto_adds_no_flag(kv_cache_dtype):
    from kvpilot.engine.arg_utils import engine_args_from_namespace
    from kvpilot.engine.config import KV_CACHE_DTYPES
    from kvpilot.engine.server.cli import build_parser
    from kvpilot.operator.crd_schema import KV_CACHE_DTYPES as CRD_KV_CACHE_DTYPES

    assert CRD_KV_CACHE_DTYPES == KV_CACHE_DTYPES  # the CRD's enum is the engine's
    base = {"model": {"source": "tiny-random"}}
    assert "--kv-cache-dtype" not in engine_args(base)
    args = engine_args({**base, "engine": {"kvCacheDtype": kv_cache_dtype}})
    assert args[args.index("--kv-cache-dtype") + 1] == kv_cache_dtype
    ns = build_parser().parse_args(args)  # what kvpilot serve makes of the operator's command line
    assert engine_args_from_namespace(ns).create_config().cache.kv_cache_dtype == kv_cache_dtype


def test_a_router_token_secret_is_owned_and_both_containers_read_it():
    """Security (issue 26 item 1): the engine trusts x-tenant only from a peer holding this token."""
    import base64
    import re

    manifest = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "smol", "namespace": "ml", "uid": "u-1", "generation": 1},
        "spec": {"model": {"source": "tiny-random"}},
    }
    isvc = InferenceService.from_manifest(manifest)
    built = build_children(isvc, "img:1")
    objects = {(o["kind"], o["metadata"]["name"]): o for o in built.objects}
    secret = objects[("Secret", "smol-router-token")]
    assert (secret["apiVersion"], secret["type"], list(secret["data"])) == ("v1", "Opaque", ["token"])
    assert secret["metadata"]["namespace"] == "ml"
    assert (
        secret["metadata"]["labels"]
        == objects[("Deployment", "smol")]["metadata"]["labels"]
        == {
            "app.kubernetes.io/name": "kvpilot",
            "app.kubernetes.io/instance": "smol",
            "app.kubernetes.io/component": "inference",
            "app.kubernetes.io/managed-by": "kvpilot-operator",
            "kvpilot.dev/inferenceservice": "smol",
        }
    )
    assert secret["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "kvpilot.dev/v1alpha1",
            "kind": "InferenceService",
            "name": "smol",
            "uid": "u-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert re.fullmatch(r"[0-9a-f]{64}", token)  # 32 random bytes

    def token_of(children: tuple[dict, ...]) -> str:
        return base64.b64decode(next(o for o in children if o["kind"] == "Secret")["data"]["token"]).decode()

    assert (
        token_of(build_children(isvc, "img:1").objects) != token
    )  # drawn afresh: apply writes it on create only
    assert token_of(build_children(isvc, "img:1", router_token="ab" * 32).objects) == "ab" * 32
    # applied before the Deployment, whose pods cannot start without it
    kinds = [o["kind"] for o in built.objects]
    assert kinds.index("Secret") < kinds.index("Deployment")

    reference = {
        "name": "KVPILOT_ROUTER_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "smol-router-token", "key": "token"}},
    }
    engine, router = objects[("Deployment", "smol")]["spec"]["template"]["spec"]["containers"]
    assert [v for v in engine["env"] if v["name"] == "KVPILOT_ROUTER_TOKEN"] == [reference]
    assert [v for v in router["env"] if v["name"] == "KVPILOT_ROUTER_TOKEN"] == [reference]


def _pod(spec: dict) -> dict:
    return children(spec)[("Deployment", "smol")]["spec"]["template"]["spec"]


def test_a_fetched_source_gets_an_init_container_a_sized_cache_and_read_only_mounts():
    digest = "a" * 64
    pod = _pod(
        {"model": {"source": "https://mirror.ml.svc/smol/q4.gguf", "sha256": digest, "sizeLimit": "2Gi"}}
    )
    (fetcher,) = pod["initContainers"]
    assert fetcher["name"] == "fetch-model" and fetcher["image"] == "img:1"
    assert fetcher["command"] == ["kvpilot", "operator", "fetch-model"]
    assert fetcher["args"] == [
        "--source",
        "https://mirror.ml.svc/smol/q4.gguf",
        "--dest",
        "/model-cache",
        "--size-limit",
        str(2 * 1024**3),
        "--sha256",
        digest,
    ]
    assert fetcher["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert fetcher["volumeMounts"] == [{"name": "model-cache", "mountPath": "/model-cache"}]
    assert fetcher["securityContext"]["readOnlyRootFilesystem"] is True and "env" not in fetcher
    assert pod["volumes"] == [
        {"name": "tmp", "emptyDir": {"sizeLimit": "10Gi"}},
        {"name": "model-cache", "emptyDir": {"sizeLimit": "2Gi"}},
    ]
    engine, router = pod["containers"]
    for container in (engine, router):
        assert {"name": "model-cache", "mountPath": "/model-cache", "readOnly": True} in container[
            "volumeMounts"
        ]
        assert container["args"][:2] == ["--model", "/model-cache/q4.gguf"]
    # both volumes on the node's disk: the scheduler needs to know
    assert engine["resources"]["requests"]["ephemeral-storage"] == f"{12 * 1024}Mi"


def test_the_scratch_volume_is_sized_from_a_known_model_or_the_spec():
    smol = _pod({"model": {"source": "smollm2-135m"}})
    # SmolLM2's float32 conversion (540 MB) plus 1 GiB of caches
    assert smol["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "1539Mi"}}]
    assert smol["containers"][0]["resources"]["requests"]["ephemeral-storage"] == "1539Mi"
    assert "initContainers" not in smol
    sized = _pod({"model": {"source": "/models/llama.gguf", "cacheSize": "64Gi"}})
    assert sized["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "64Gi"}}]


def test_fetch_credentials_reach_only_the_init_container():
    s3 = _pod(
        {
            "model": {
                "source": "s3://models/llama/q4.gguf",
                "endpoint": "https://minio.storage.svc:9000",
                "region": "eu-west-1",
                "credentialsSecret": "s3-reader",
            }
        }
    )
    fetcher = s3["initContainers"][0]
    assert fetcher["args"][-4:] == ["--endpoint", "https://minio.storage.svc:9000", "--region", "eu-west-1"]
    assert fetcher["env"] == [
        {
            "name": "AWS_ACCESS_KEY_ID",
            "valueFrom": {"secretKeyRef": {"name": "s3-reader", "key": "AWS_ACCESS_KEY_ID"}},
        },
        {
            "name": "AWS_SECRET_ACCESS_KEY",
            "valueFrom": {"secretKeyRef": {"name": "s3-reader", "key": "AWS_SECRET_ACCESS_KEY"}},
        },
        {
            "name": "AWS_SESSION_TOKEN",
            "valueFrom": {
                "secretKeyRef": {"name": "s3-reader", "key": "AWS_SESSION_TOKEN", "optional": True}
            },
        },
    ]
    hf = _pod(
        {
            "model": {
                "source": "hf://org/name@v2",
                "endpoint": "http://hf-mirror.ml",
                "credentialsSecret": "hf",
            }
        }
    )
    assert hf["initContainers"][0]["env"] == [
        {"name": "KVPILOT_FETCH_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    ]
    assert hf["containers"][0]["args"][:2] == ["--model", "/model-cache/org--name--v2"]
    for container in hf["containers"]:
        assert not any(e["name"] == "KVPILOT_FETCH_TOKEN" for e in container["env"])


def test_scale_to_zero_adds_the_activator_and_points_the_service_at_it_while_no_replica_is_ready():
    spec = {
        "model": {"source": "smollm2-135m"},
        "scaling": {"perReplicaGoodput": 2, "minReplicas": 0, "spare": 0},
        "autoscaling": {"mode": "operator", "activatorHoldSeconds": 120},
    }
    isvc = InferenceService.from_manifest(
        {
            "apiVersion": "kvpilot.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "smol", "namespace": "ml", "uid": "u-1"},
            "spec": spec,
        }
    )
    at_zero = {(o["kind"], o["metadata"]["name"]): o for o in build_children(isvc, ready_replicas=0).objects}
    serving = {(o["kind"], o["metadata"]["name"]): o for o in build_children(isvc, ready_replicas=1).objects}
    assert at_zero[("Service", "smol")]["spec"]["selector"] == {"kvpilot.dev/activator": "smol"}
    assert serving[("Service", "smol")]["spec"]["selector"] == {"kvpilot.dev/inferenceservice": "smol"}
    # going to zero, with the last replica still Ready: the activator takes over first
    zero = replace(build_children(isvc).sizing, desired=0, serving=0, unclamped=0)
    leaving = {
        (o["kind"], o["metadata"]["name"]): o
        for o in build_children(isvc, sizing=zero, ready_replicas=1).objects
    }
    assert leaving[("Service", "smol")]["spec"]["selector"] == {"kvpilot.dev/activator": "smol"}
    assert leaving[("Deployment", "smol")]["spec"]["replicas"] == 0
    activator = at_zero[("Deployment", "smol-activator")]["spec"]
    assert activator["replicas"] == 1
    labels = activator["template"]["metadata"]["labels"]
    # never counted as a replica, never behind the engines' Service or the PodDisruptionBudget
    assert "kvpilot.dev/inferenceservice" not in labels and labels["kvpilot.dev/activator"] == "smol"
    pod = activator["template"]["spec"]
    assert pod["serviceAccountName"] == "smol-router"
    (container,) = pod["containers"]
    assert container["command"] == ["kvpilot", "operator", "activator"]
    assert container["args"] == [
        "--namespace",
        "ml",
        "--name",
        "smol",
        "--port",
        "8080",
        "--queue-size",
        "256",
        "--hold-timeout",
        "120",
    ]
    assert container["ports"] == [{"name": "http-router", "containerPort": 8080, "protocol": "TCP"}]
    # without scale to zero: no activator
    plain = children({"model": {"source": "smollm2-135m"}})
    assert ("Deployment", "smol-activator") not in plain
