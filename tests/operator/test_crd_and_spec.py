"""The CRD is generated from the one schema source, and the operator validates specs by the same rules."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvpilot.operator.crd import crd_manifest, crd_yaml
from kvpilot.operator.crd_rules import RULES
from kvpilot.operator.spec import InferenceService, SpecError

REPO = Path(__file__).resolve().parents[2]


def isvc(spec: dict, name: str = "smol") -> dict:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": "ml"},
        "spec": spec,
    }


@pytest.mark.parametrize(
    "path",
    ["crds/inferenceservices.kvpilot.dev.yaml", "charts/kvpilot/crds/inferenceservices.kvpilot.dev.yaml"],
)
def test_checked_in_crds_are_exactly_the_generated_one(path):
    assert (REPO / path).read_text() == crd_yaml(), f"regenerate with: kvpilot operator crd > {path}"


def test_crd_names_columns_and_status_subresource():
    crd = yaml.safe_load(crd_yaml())
    assert crd == crd_manifest()
    assert crd["metadata"]["name"] == "inferenceservices.kvpilot.dev"
    assert crd["spec"]["names"]["shortNames"] == ["kvis"]
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1"
    # The scale subresource: kubectl scale, an HPA and KEDA read and write spec.replicas through it.
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Model",
        "Desired",
        "Ready",
        "Phase",
        "Autoscaling",
        "Age",
    ]


def _validations(schema: dict, path: str = "") -> set[tuple[str, str, str]]:
    found = {(path, v["rule"], v["fieldPath"]) for v in schema.get("x-kubernetes-validations", [])}
    for key, sub in schema.get("properties", {}).items():
        found |= _validations(sub, f"{path}.{key}".lstrip("."))
    return found


def test_every_cross_field_rule_is_in_the_crd_as_cel_at_its_node():
    schema = yaml.safe_load(crd_yaml())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    expected = {(".".join(rule.node), rule.cel, f".{rule.field}") for rule in RULES}
    assert _validations(schema) == expected


def test_defaults_fill_the_spec():
    spec = InferenceService.from_manifest(isvc({"model": {"source": "smollm2-135m"}})).spec
    assert spec.model.served_name == "smol"
    assert (spec.engine.block_size, spec.engine.max_num_seqs, spec.engine.kv_cache_memory) == (16, 64, None)
    assert (spec.engine.gpu_memory_utilization, spec.kv_cache_memory_bytes) == (0.9, 1 << 30)  # CPU: 1Gi
    assert (spec.scaling.replicas, spec.scaling.spare, spec.scaling.headroom) == (None, 1, 0.2)
    assert (spec.router.policy, spec.resources.gpus, spec.slo.ttft_seconds) == ("cache_aware", 0, 2.0)
    autoscaling = spec.autoscaling
    assert (autoscaling.mode, autoscaling.prometheus_url, autoscaling.interval_seconds) == ("off", None, 15)
    windows = (autoscaling.scale_up_stabilization_seconds, autoscaling.scale_down_stabilization_seconds)
    assert windows == (0, 300)
    assert (autoscaling.cooldown_seconds, autoscaling.min_goodput_samples, spec.replicas) == (60, 3, None)


@pytest.mark.parametrize(
    ("spec", "field", "message"),
    [
        ({}, "spec.model", "Required value"),
        ({"model": {"source": "gpt-9"}}, "spec.model.source", "does not match"),
        (
            {"model": {"source": "smollm2-135m"}, "scaling": {"spare": -1}},
            "spec.scaling.spare",
            "less than the minimum",
        ),
        (
            {"model": {"source": "smollm2-135m"}, "router": {"policy": "random"}},
            "spec.router.policy",
            "is not one of",
        ),
        (
            {"model": {"source": "smollm2-135m"}, "engine": {"blockSize": 12}},
            "spec.engine.blockSize",
            "is not one of",
        ),
        (
            {
                "model": {"source": "smollm2-135m"},
                "scaling": {"replicas": 2, "targetRequestsPerSecond": 3, "perReplicaGoodput": 1},
            },
            "spec.scaling.replicas",
            "set either scaling.replicas or scaling.targetRequestsPerSecond, not both",
        ),
        (
            {"model": {"source": "smollm2-135m"}, "scaling": {"targetRequestsPerSecond": 3}},
            "spec.scaling.perReplicaGoodput",
            "given together",
        ),
        (
            {"model": {"source": "smollm2-135m"}, "scaling": {"perReplicaGoodput": 3}},
            "spec.scaling.perReplicaGoodput",
            "perReplicaGoodput alone only with autoscaling.mode operator",
        ),
        (
            {"model": {"source": "smollm2-135m"}, "autoscaling": {"mode": "operator"}},
            "spec.autoscaling.mode",
            "autoscaling.mode operator needs scaling.perReplicaGoodput",
        ),
        (
            {"model": {"source": "smollm2-135m"}, "autoscaling": {"mode": False}},
            "spec.autoscaling.mode",
            "is not of type 'string'",
        ),
        (
            {"model": {"source": "smollm2-135m"}, "scaling": {"minReplicas": 5, "maxReplicas": 2}},
            "spec.scaling.minReplicas",
            "must not exceed",
        ),
        (
            {"model": {"source": "smollm2-135m"}, "engine": {"maxNumSeqs": 512, "maxNumBatchedTokens": 256}},
            "spec.engine.maxNumBatchedTokens",
            "at least engine.maxNumSeqs",
        ),
        (
            {"model": {"source": "smollm2-135m"}, "engine": {"extraArgs": ["--port=9000"]}},
            "spec.engine.extraArgs",
            "must not repeat a flag",
        ),
        (
            {"model": {"source": "smollm2-135m"}, "resources": {"gpuType": "H100"}},
            "spec.resources.gpuType",
            "gpus > 0",
        ),
        (
            {"model": {"source": "smollm2-135m"}, "engine": {"kvCacheMemory": "8Gi"}},
            "spec.engine.kvCacheMemory",
            "less than resources.memory",
        ),
        (
            {"model": {"source": "smollm2-135m"}, "resources": {"memory": "1Gi"}},
            "spec.engine.kvCacheMemory",
            "(1Gi when unset) must be less than resources.memory",
        ),
        (
            {"model": {"source": "smollm2-135m"}, "engine": {"gpuMemoryUtilization": 0}},
            "spec.engine.gpuMemoryUtilization",
            "0 is less than or equal to the minimum of 0",
        ),
        (
            {"model": {"source": "smollm2-135m"}, "engine": {"gpuMemoryUtilization": 1.5}},
            "spec.engine.gpuMemoryUtilization",
            "1.5 is greater than the maximum of 1",
        ),
        (
            {"model": {"source": "smollm2-135m"}, "engine": {"extraArgs": ["--gpu-memory-utilization=0.5"]}},
            "spec.engine.extraArgs",
            "must not repeat a flag",
        ),
        (
            {"model": {"source": "smollm2-135m"}, "engine": {"extraArgs": ["--kv-cache-dtype", "int8"]}},
            "spec.engine.extraArgs",
            "must not repeat a flag",
        ),
        (
            {"model": {"source": "smollm2-135m"}, "engine": {"kvCacheDtype": "fp8_e5m2"}},
            "spec.engine.kvCacheDtype",
            "'fp8_e5m2' is not one of ['auto', 'fp8', 'int8']",
        ),
        (
            {"model": {"source": "smollm2-135m", "quantization": "fp8"}},
            "spec.model.quantization",
            "keeps e4m3 weights on GPUs",
        ),
        (
            {
                "model": {"source": "smollm2-135m"},
                "engine": {"activationQuantization": "int8"},
                "resources": {"gpus": 1},
            },
            "spec.engine.activationQuantization",
            "runs gguf/int8 weights on CPU replicas",
        ),
        (
            {"model": {"source": "smollm2-135m"}, "engine": {"activationQuantization": "fp8"}},
            "spec.engine.activationQuantization",
            "(W8A8) runs fp8 weights on GPUs",
        ),
        (
            {"model": {"source": "smollm2-135m", "quantization": "q4"}},
            "spec.model.quantization",
            "'q4' is not one of",
        ),
        (
            {"model": {"source": "smollm2-135m"}, "router": {"weights": {"Prefill": 1}}},
            "spec.router.weights",
            "Prefill",
        ),
        # model delivery
        ({"model": {"source": "ftp://host/m.gguf"}}, "spec.model.source", "does not match"),
        ({"model": {"source": "https://host/m.bin"}}, "spec.model.source", "does not match"),  # not a GGUF
        ({"model": {"source": "s3://Bucket/m.gguf", "endpoint": "http://s3"}}, "spec.model.source", "match"),
        (
            {"model": {"source": "https://host/m.gguf", "sha256": "ABC"}},
            "spec.model.sha256",
            "does not match",
        ),
        (
            {"model": {"source": "hf://org/name", "sha256": "a" * 64}},
            "spec.model.sha256",
            "pin an hf:// repository by its revision instead",
        ),
        (
            {"model": {"source": "smollm2-135m", "sha256": "a" * 64}},
            "spec.model.sha256",
            "checks one fetched",
        ),
        (
            {"model": {"source": "s3://bucket/m.gguf"}},
            "spec.model.endpoint",
            "an s3:// source needs model.endpoint",
        ),
        (
            {"model": {"source": "pvc://models/x", "credentialsSecret": "creds"}},
            "spec.model.credentialsSecret",
            "applies only to fetched sources",
        ),
        ({"model": {"source": "https://host/m.gguf", "sizeLimit": "-1Gi"}}, "spec.model.sizeLimit", "match"),
    ],
)
def test_invalid_specs_name_the_field(spec, field, message):
    with pytest.raises(SpecError) as error:
        InferenceService.from_manifest(isvc(spec))
    assert error.value.field == field
    assert message in error.value.message


def test_more_gpus_than_a_node_has_are_refused_naming_the_field_and_why():
    resources = yaml.safe_load(crd_yaml())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
        "spec"
    ]["properties"]["resources"]["properties"]
    assert (resources["gpus"]["minimum"], resources["gpus"]["maximum"]) == (
        0,
        8,
    )  # what kubectl apply enforces
    with pytest.raises(SpecError) as error:  # what the operator reports for an object an older CRD let in
        InferenceService.from_manifest(
            isvc({"model": {"source": "pvc://models/llama"}, "resources": {"gpus": 9}})
        )
    assert (error.value.field, error.value.message) == (
        "spec.resources.gpus",
        "Invalid value: 9: 9 is greater than the maximum of 8 (GPUs per replica (nvidia.com/gpu), all on "
        "one node: more than 1 splits the model over them (the engine's --tensor-parallel-size); a model of "
        "known shape must split that many ways. Several nodes per replica (pipeline parallelism) are not "
        "supported yet)",
    )


@pytest.mark.parametrize("gpus", [0, 1])
def test_zero_or_one_gpu_is_accepted(gpus):
    spec = InferenceService.from_manifest(
        isvc({"model": {"source": "pvc://models/llama"}, "resources": {"gpus": gpus}})
    ).spec
    assert spec.resources.gpus == gpus


def test_gpu_pods_without_kv_memory_have_no_fixed_kv_size():
    engine = yaml.safe_load(crd_yaml())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
        "spec"
    ]["properties"]["engine"]["properties"]
    assert "default" not in engine["kvCacheMemory"]
    assert (
        engine["gpuMemoryUtilization"]["default"],
        engine["gpuMemoryUtilization"]["exclusiveMinimum"],
    ) == (0.9, True)
    gpu = InferenceService.from_manifest(
        isvc({"model": {"source": "pvc://models/llama"}, "resources": {"gpus": 1}})
    ).spec
    assert (gpu.engine.kv_cache_memory, gpu.kv_cache_memory_bytes) == (None, None)
    fixed = InferenceService.from_manifest(
        isvc(
            {
                "model": {"source": "pvc://models/llama"},
                "engine": {"kvCacheMemory": "2Gi"},
                "resources": {"gpus": 1},
            }
        )
    ).spec
    assert fixed.kv_cache_memory_bytes == 2 << 30


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        # CPU: 540 MB of float32 weights + the 1Gi default KV cache + 256Mi of runtime = 1795Mi
        (
            {"model": {"source": "smollm2-135m"}, "resources": {"memory": "1536Mi"}},
            "smollm2-135m needs at least 1795Mi (its float32 weights and the KV cache live in the pod's "
            "memory, beside the engine's runtime), got 1536Mi",
        ),
        # GPU: weights and KV cache on the device, but the conversion holds the 540 MB float32 shard: 771Mi
        (
            {"model": {"source": "smollm2-135m"}, "resources": {"gpus": 1, "memory": "768Mi"}},
            "smollm2-135m needs at least 771Mi (its weights are converted to float32 in the pod's memory, "
            "shard by shard, before they stream to the GPU, beside the engine's runtime), got 768Mi",
        ),
    ],
)
def test_memory_below_what_the_known_model_needs_is_refused(spec, message):
    with pytest.raises(SpecError) as error:
        InferenceService.from_manifest(isvc(spec))
    assert (error.value.field, error.value.message) == ("spec.resources.memory", message)


@pytest.mark.parametrize(
    "spec",
    [
        {"model": {"source": "smollm2-135m"}, "resources": {"memory": "1795Mi"}},
        {"model": {"source": "smollm2-135m"}, "resources": {"gpus": 1, "memory": "771Mi"}},
        {
            "model": {"source": "smollm2-135m", "dtype": "float32"},
            "resources": {"memory": "2Gi"},
            "engine": {"kvCacheMemory": "256Mi"},
        },
        {
            "model": {"source": "pvc://models/llama"},
            "resources": {"memory": "1100Mi"},
        },  # size unknown: not checked
    ],
)
def test_memory_that_fits_the_model_or_an_unknown_model_is_accepted(spec):
    InferenceService.from_manifest(isvc(spec))


def test_gpu_kv_memory_may_exceed_pod_memory_and_pvc_source_maps_to_its_mount():
    spec = InferenceService.from_manifest(
        isvc(
            {
                "model": {"source": "pvc://models/llama/8b"},
                "resources": {"gpus": 1, "memory": "16Gi"},
                "engine": {"kvCacheMemory": "40Gi"},
            }
        )
    ).spec
    assert (spec.model.pvc_claim, spec.model.engine_path) == ("models", "/models/models/llama/8b")


def test_router_weights_accept_exactly_the_router_knobs():
    import jsonschema

    from kvpilot.operator.crd_schema import ROUTER_WEIGHT_KEYS, spec_schema
    from kvpilot.router.config import ScoringWeights

    assert ROUTER_WEIGHT_KEYS == ("queue", "prefill", "decode", "balance", "balance_floor", "tie_ms")
    ScoringWeights.parse(",".join(f"{k}=1" for k in ROUTER_WEIGHT_KEYS))  # every key is one the router takes
    weights = spec_schema()["properties"]["router"]["properties"]["weights"]
    jsonschema.validate({"prefill": 1.5, "tie_ms": 3}, weights)
    with pytest.raises(jsonschema.ValidationError, match="typo"):
        jsonschema.validate({"typo": 1}, weights)


@pytest.mark.parametrize(
    "model",
    [
        {"source": "https://mirror.example/models/smol.Q4_1.gguf", "sha256": "0" * 64, "sizeLimit": "1Gi"},
        {"source": "http://models.ml.svc:8080/m.gguf?token=x"},
        {
            "source": "s3://ml-models/llama/q4.gguf",
            "endpoint": "https://minio:9000",
            "credentialsSecret": "s3",
        },
        {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct@main", "endpoint": "http://hf-mirror.ml.svc"},
        {"source": "hf://org/name/dir/file.gguf", "sha256": "f" * 64},
    ],
)
def test_fetched_sources_are_accepted(model):
    spec = InferenceService.from_manifest(isvc({"model": model})).spec.model
    assert spec.fetch is not None and spec.engine_path.startswith("/model-cache/")


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (
            {"model": {"source": "smollm2-135m"}, "engine": {"kvCacheMemory": "1Gi\n"}},
            "spec.engine.kvCacheMemory",
        ),
        ({"model": {"source": "smollm2-135m"}, "resources": {"memory": "4Gi\n"}}, "spec.resources.memory"),
        ({"model": {"source": "smollm2-135m\n"}}, "spec.model.source"),
        ({"model": {"source": "s3://models/m.gguf", "endpoint": "http://minio\n"}}, "spec.model.endpoint"),
    ],
)
def test_a_trailing_newline_fails_the_pattern_as_on_the_api_server(spec, field):
    # The API server matches patterns with RE2, whose $ is the end of the text; Python's $ also matched
    # before a final newline, and "1Gi\n" then broke parse_quantity with a ValueError.
    with pytest.raises(SpecError) as error:
        InferenceService.from_manifest(isvc(spec))
    assert error.value.field == field
    assert "does not match" in error.value.message


@pytest.mark.parametrize(
    "source",
    ["/models/my\u00a0model.gguf", "https://host/a\u2003b.gguf", "hf://org/repo/sub\u00a0dir/m.gguf"],
)
def test_patterns_class_unicode_spaces_as_re2_does(source):
    # RE2's \s is ASCII whitespace: the API server admits a no-break space in a path, so the operator must
    # not refuse what was admitted (Python's \s matched it, and these were InvalidSpec).
    spec = InferenceService.from_manifest(isvc({"model": {"source": source}})).spec.model
    assert spec.source == source
