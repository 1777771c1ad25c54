"""``engine.speculative`` (docs/architecture.md#speculative-decoding): the CRD field becomes the engine's
``--speculative-config`` with vLLM's keys, the engine parses what the operator writes, and bad combinations
are refused naming the field, by the operator's validation and by the CRD's CEL rules alike."""

from __future__ import annotations

import json

import pytest

from kvpilot.engine.spec_decode.config import parse_speculative_config
from kvpilot.operator.children import build_children
from kvpilot.operator.crd import crd_manifest
from kvpilot.operator.spec import InferenceService, SpecError


def manifest(engine: dict) -> dict:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "smol", "namespace": "ml", "uid": "u-1"},
        "spec": {"model": {"source": "smollm2-135m"}, "engine": engine},
    }


def engine_args(engine: dict) -> list[str]:
    built = build_children(InferenceService.from_manifest(manifest(engine)), "img:1")
    deployment = next(
        o for o in built.objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "smol"
    )
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def speculative_config(engine: dict) -> dict | None:
    args = engine_args(engine)
    if "--speculative-config" not in args:
        return None
    return json.loads(args[args.index("--speculative-config") + 1])


def test_ngram_becomes_the_engines_speculative_config_with_its_defaults():
    config = speculative_config({"speculative": {"method": "ngram", "numSpeculativeTokens": 3}})
    assert config == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 4,
        "disable_by_batch_size": 4,
    }
    parsed = parse_speculative_config(config)  # what the engine makes of it
    assert parsed is not None and parsed.ngram.num_speculative_tokens == 3


def test_a_draft_model_passes_its_model_and_no_prompt_lookup_keys():
    engine = {
        "speculative": {"method": "draft_model", "numSpeculativeTokens": 2, "draftModel": "tiny-random"}
    }
    config = speculative_config(engine)
    assert config == {
        "method": "draft_model",
        "num_speculative_tokens": 2,
        "model": "tiny-random",
        "disable_by_batch_size": 4,
    }
    parsed = parse_speculative_config(config)
    assert parsed is not None and parsed.model == "tiny-random"


def test_no_speculative_block_no_flag():
    assert speculative_config({}) is None


@pytest.mark.parametrize(
    ("speculative", "field", "message"),
    [
        (
            {"method": "draft_model", "numSpeculativeTokens": 2},
            "spec.engine.speculative.draftModel",
            "required",
        ),
        (
            {"method": "ngram", "numSpeculativeTokens": 2, "draftModel": "x"},
            "spec.engine.speculative.draftModel",
            "only there",
        ),
        (
            {"method": "ngram", "numSpeculativeTokens": 2, "promptLookupMin": 5, "promptLookupMax": 2},
            "spec.engine.speculative.promptLookupMin",
            "must not exceed",
        ),
        ({"method": "ngram", "numSpeculativeTokens": 0}, "spec.engine.speculative.numSpeculativeTokens", "0"),
        ({"method": "eagle", "numSpeculativeTokens": 2}, "spec.engine.speculative.method", "eagle"),
        ({"numSpeculativeTokens": 2}, "spec.engine.speculative.method", "Required"),
    ],
)
def test_bad_speculative_blocks_name_the_field(speculative, field, message):
    with pytest.raises(SpecError) as error:
        InferenceService.from_manifest(manifest({"speculative": speculative}))
    assert error.value.field == field
    assert message in error.value.message


def test_extra_args_cannot_smuggle_a_second_speculative_config():
    with pytest.raises(SpecError) as error:
        InferenceService.from_manifest(manifest({"extraArgs": ["--speculative-config={}"]}))
    assert error.value.field == "spec.engine.extraArgs"


def test_the_crd_carries_the_rules_as_cel():
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    speculative = schema["properties"]["spec"]["properties"]["engine"]["properties"]["speculative"]
    rules = {v["fieldPath"]: v["rule"] for v in speculative["x-kubernetes-validations"]}
    assert rules == {
        ".draftModel": "(self.method == 'draft_model') == has(self.draftModel)",
        ".promptLookupMin": "self.promptLookupMin <= self.promptLookupMax",
    }
    assert speculative["required"] == ["method", "numSpeculativeTokens"]
