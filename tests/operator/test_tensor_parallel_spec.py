"""``resources.gpus`` above 1 is the engine's tensor parallelism (docs/architecture.md#tensor-parallelism):
the Deployment's engine gets ``--tensor-parallel-size``, a memory-backed ``/dev/shm`` and the NCCL
environment; a model of known shape that the GPUs do not split is refused naming the field (the
InvalidSpec condition), and so is multi-node pipeline parallelism; the engine accepts what the operator
writes."""

from __future__ import annotations

import pytest

from kvpilot.engine.arg_utils import add_engine_args, engine_args_from_namespace
from kvpilot.operator.children import build_children
from kvpilot.operator.crd import crd_manifest
from kvpilot.operator.spec import InferenceService, SpecError


def manifest(gpus: int, source: str = "smollm2-135m", extra_args: tuple[str, ...] = ()) -> dict:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "smol", "namespace": "ml", "uid": "u-1"},
        "spec": {
            "model": {"source": source},
            "resources": {"gpus": gpus, "memory": "16Gi"},
            "engine": {"extraArgs": list(extra_args)},
        },
    }


def pod_spec(gpus: int, source: str = "smollm2-135m") -> dict:
    built = build_children(InferenceService.from_manifest(manifest(gpus, source)), "img:1")
    deployment = next(
        o for o in built.objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "smol"
    )
    return deployment["spec"]["template"]["spec"]


def engine_container(spec: dict) -> dict:
    return next(c for c in spec["containers"] if c["name"] == "engine")


def test_three_gpus_split_smollm2_three_ways_with_shared_memory_and_nccl_env():
    spec = pod_spec(3)
    engine = engine_container(spec)
    args = engine["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "3"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "3"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in spec["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env["NCCL_DEBUG"] == "WARN" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"

    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns, _ = parser.parse_known_args(args)  # the server's own flags (--port, --slo-*) aside
    assert engine_args_from_namespace(ns).create_config().tensor_parallel_size == 3


@pytest.mark.parametrize("gpus", [0, 1])
def test_one_gpu_or_none_has_no_tensor_parallelism(gpus):
    spec = pod_spec(gpus)
    engine = engine_container(spec)
    assert "--tensor-parallel-size" not in engine["args"]
    assert all(v["name"] != "dshm" for v in spec["volumes"])
    assert all(not e["name"].startswith(("NCCL_", "TORCH_NCCL")) for e in engine["env"])


@pytest.mark.parametrize(
    ("gpus", "source", "message"),
    [
        (
            2,
            "smollm2-135m",
            "smollm2-135m has 9 attention heads, which 2 GPUs do not divide (use one of [1, 3, 9])",
        ),
        (4, "smollm2-135m", "smollm2-135m has 9 attention heads, which 4 GPUs do not divide"),
        (
            3,
            "tiny-random",
            "tiny-random has 4 attention heads, which 3 GPUs do not divide (use one of [1, 2, 4])",
        ),
    ],
)
def test_gpus_that_do_not_split_a_known_model_are_refused_naming_the_field(gpus, source, message):
    with pytest.raises(SpecError) as error:
        InferenceService.from_manifest(manifest(gpus, source))
    assert error.value.field == "spec.resources.gpus"
    assert error.value.message.startswith(message)


def test_a_model_of_unknown_shape_is_left_to_the_engine():
    spec = pod_spec(2, "/models/llama-70b")
    args = engine_container(spec)["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--pipeline-parallel-size=2", "pipeline parallelism across nodes is not supported yet"),
        ("-pp", "pipeline parallelism across nodes is not supported yet"),
        ("--tensor-parallel-size=2", "must not repeat a flag the operator sets from the spec"),
    ],
)
def test_extra_args_cannot_ask_for_pipeline_parallelism_or_a_second_tp_size(flag, message):
    with pytest.raises(SpecError) as error:
        InferenceService.from_manifest(manifest(3, extra_args=(flag,)))
    assert error.value.field == "spec.engine.extraArgs"
    assert message in error.value.message


def test_the_crd_allows_a_nodes_gpus_and_carries_the_pipeline_rule_as_cel():
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert schema["properties"]["resources"]["properties"]["gpus"]["maximum"] == 8
    rules = [v["rule"] for v in schema["properties"]["engine"]["x-kubernetes-validations"]]
    # (?s) and the whole-text anchors: RE2's $ is the end of the text, as Python's fullmatch (crd_rules.py)
    assert "self.extraArgs.all(a, !a.matches('(?s)^(?:(?:--pipeline-parallel-size|-pp)(?:=.*)?)$'))" in rules
