"""A spec the operator refuses surfaces as a status condition, and nothing reaches the cluster."""

from __future__ import annotations

import base64
import copy
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e"))  # the harness package (read only)

from harness.patches import merge_patch  # RFC 7386, as the harness API server applies it

from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.reconcile import reconcile


class NoApi:
    """Any call fails the test: an invalid spec must not create, patch or even read children."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"reconcile called KubeApi.{name} for an invalid spec")


def test_gpus_that_do_not_split_the_model_are_reported_and_build_no_deployment():
    # docs/architecture.md#tensor-parallelism: resources.gpus is the engine's tensor-parallel size, and
    # SmolLM2's 9 attention heads do not split two ways; the CRD cannot know that, the operator does.
    body = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "smol", "namespace": "ml", "uid": "u-1", "generation": 4},
        "spec": {"model": {"source": "smollm2-135m"}, "resources": {"gpus": 2, "memory": "64Gi"}},
    }
    result = reconcile(NoApi(), body, OperatorConfig(default_image="img:1"))
    assert (result.applied, result.error.field) == ((), "spec.resources.gpus")
    status = result.status_patch
    assert (status["phase"], status["observedGeneration"]) == ("Failed", 4)
    message = (
        "spec.resources.gpus: smollm2-135m has 9 attention heads, which 2 GPUs do not divide (use one of "
        "[1, 3, 9]): the replica's GPUs split the model (tensor parallelism)"
    )
    assert [(c["type"], c["status"], c["reason"], c["message"]) for c in status["conditions"]] == [
        ("Ready", "False", "InvalidSpec", message),
        ("Progressing", "False", "Idle", message),
        ("Degraded", "True", "InvalidSpec", message),
    ]


class MemoryApi:
    """Objects by (kind, namespace, name); create, get, JSON merge patch and list as the API server does."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str | None], dict[str, Any]] = {}
        self.writes: list[tuple[str, str, dict[str, Any]]] = []

    @staticmethod
    def _key(ref: Any) -> tuple[str, str, str | None]:
        return ref.kind, ref.namespace, ref.name

    def get(self, ref: Any) -> dict[str, Any] | None:
        found = self.objects.get(self._key(ref))
        return copy.deepcopy(found) if found is not None else None

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        assert key not in self.objects
        self.objects[key] = copy.deepcopy(obj)
        self.writes.append(("create", obj["kind"], obj))
        return obj

    def merge_patch(self, ref: Any, patch: dict[str, Any], subresource: str = "") -> dict[str, Any]:
        self.objects[self._key(ref)] = merge_patch(self.objects[self._key(ref)], patch)
        self.writes.append(("patch", ref.kind, patch))
        return self.objects[self._key(ref)]

    def list(self, ref: Any, label_selector: str) -> list[dict[str, Any]]:
        return []


def test_later_reconciles_keep_the_router_token_and_never_write_it_anywhere_else():
    """Security (issue 26 item 1): the token stays what running pods read, and stays out of metadata."""
    body = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "smol", "namespace": "ml", "uid": "u-1", "generation": 1},
        "spec": {"model": {"source": "tiny-random"}},
    }
    api, config = MemoryApi(), OperatorConfig(default_image="img:1")
    first = reconcile(api, body, config)
    assert {r.action for r in first.applied} == {"created"}
    secret_key = ("Secret", "ml", "smol-router-token")
    token = base64.b64decode(api.objects[secret_key]["data"]["token"]).decode()
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    assert token not in json.dumps(api.objects[secret_key]["metadata"])  # not in the last-applied annotation

    api.writes.clear()
    second = reconcile(api, body, config)  # its builder drew another token
    assert {r.action for r in second.applied} == {"unchanged"} and api.writes == []
    assert base64.b64decode(api.objects[secret_key]["data"]["token"]).decode() == token

    # Managed metadata is still reconciled, the token still not touched.
    api.objects[secret_key]["metadata"]["labels"]["app.kubernetes.io/instance"] = "other"
    api.objects[secret_key]["data"]["extra"] = "eA=="
    third = reconcile(api, body, config)
    patched = [r for r in third.applied if r.action == "patched"]
    assert [(r.ref.kind, r.patch) for r in patched] == [
        ("Secret", {"metadata": {"labels": {"app.kubernetes.io/instance": "smol"}}})
    ]
    assert base64.b64decode(api.objects[secret_key]["data"]["token"]).decode() == token

    # A token key removed by hand is put back (pods could not start without it); the rest is left alone.
    del api.objects[secret_key]["data"]["token"]
    reconcile(api, body, config)
    data = api.objects[secret_key]["data"]
    assert set(data) == {"token", "extra"} and re.fullmatch(
        r"[0-9a-f]{64}", base64.b64decode(data["token"]).decode()
    )


def test_external_mode_beyond_max_replicas_reports_no_capacity_limit():
    body = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "m", "namespace": "ml", "uid": "u-1", "generation": 1},
        "spec": {"model": {"source": "tiny-random"}, "autoscaling": {"mode": "external"}, "replicas": 150},
    }
    api = MemoryApi()
    status = reconcile(api, body, OperatorConfig(default_image="img:1")).status_patch
    assert api.objects[("Deployment", "ml", "m")]["spec"]["replicas"] == 150
    assert status["sizing"]["capacityLimited"] is False
    limited = next(c for c in status["conditions"] if c["type"] == "CapacityLimited")
    assert (limited["status"], limited["reason"], limited["message"]) == (
        "False",
        "ExternalReplicas",
        "autoscaling.mode external: spec.replicas 150 runs as set (the external autoscaler's bounds apply, "
        "not scaling.maxReplicas)",
    )


def test_the_status_endpoint_is_in_the_configured_cluster_domain():
    body = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "smol", "namespace": "ml", "uid": "u-1", "generation": 1},
        "spec": {"model": {"source": "tiny-random"}},
    }
    default = reconcile(MemoryApi(), body, OperatorConfig(default_image="img:1")).status_patch
    assert default["endpoint"] == "http://smol.ml.svc.cluster.local"
    config = OperatorConfig(default_image="img:1", cluster_domain="corp.example")
    assert reconcile(MemoryApi(), body, config).status_patch["endpoint"] == "http://smol.ml.svc.corp.example"
