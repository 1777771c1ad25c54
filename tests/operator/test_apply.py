"""Reconcile against an API server stand-in: removals roll out, canonical quantities are not drift."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e"))  # the harness package (read only)

from harness.patches import merge_patch  # RFC 7386, as the harness API server applies it

from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.reconcile import reconcile

CONFIG = OperatorConfig(default_image="img:1")
# What apimachinery's Quantity.String() makes of these (kube-apiserver stores the canonical form).
CANONICAL = {"1.5Gi": "1536Mi", "20480Mi": "20Gi"}


class ApiServer:
    """Objects by (kind, namespace, name): create, get, JSON merge patch; emptyDir sizes canonicalised."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.writes: list[tuple[str, str, str]] = []

    def _store(self, key: tuple[str, str, str], obj: dict[str, Any]) -> dict[str, Any]:
        for volume in obj.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", []):
            empty_dir = volume.get("emptyDir") or {}
            if empty_dir.get("sizeLimit") in CANONICAL:
                empty_dir["sizeLimit"] = CANONICAL[empty_dir["sizeLimit"]]
        self.objects[key] = obj
        return copy.deepcopy(obj)

    def get(self, ref: Any) -> dict[str, Any] | None:
        found = self.objects.get((ref.kind, ref.namespace, ref.name))
        return copy.deepcopy(found) if found is not None else None

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        self.writes.append(("create", *key[::2]))
        return self._store(key, copy.deepcopy(obj))

    def merge_patch(self, ref: Any, patch: dict[str, Any], subresource: str = "") -> dict[str, Any]:
        key = (ref.kind, ref.namespace, ref.name)
        self.writes.append(("patch", ref.kind, ref.name))
        return self._store(key, merge_patch(self.objects[key], patch))

    def list(self, ref: Any, label_selector: str) -> list[dict[str, Any]]:
        return []


def _isvc(name: str, spec: dict[str, Any], generation: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}", "generation": generation},
        "spec": spec,
    }


def _pod_spec(api: ApiServer, name: str) -> dict[str, Any]:
    return api.objects[("Deployment", "ml", name)]["spec"]["template"]["spec"]


def test_gpus_one_to_zero_takes_the_gpu_out_of_the_pod_template():
    # A fixed KV cache: nothing else in the engine container changes with the GPU count.
    api, model, engine = ApiServer(), {"source": "/models/m.gguf"}, {"kvCacheMemory": "2Gi"}
    gpu = {"model": model, "engine": engine, "resources": {"gpus": 1, "memory": "16Gi"}}
    reconcile(api, _isvc("m", gpu), CONFIG)
    assert _pod_spec(api, "m")["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    cpu = {"model": model, "engine": engine, "resources": {"gpus": 0, "memory": "16Gi"}}
    reconcile(api, _isvc("m", cpu, 2), CONFIG)
    resources = _pod_spec(api, "m")["containers"][0]["resources"]
    assert "nvidia.com/gpu" not in resources["limits"] and "nvidia.com/gpu" not in resources["requests"]
    assert "tolerations" not in _pod_spec(api, "m")


def test_removing_credentials_secret_takes_its_env_var_out_of_the_fetcher():
    api, source = ApiServer(), "https://mirror.example/m.gguf"
    reconcile(api, _isvc("m", {"model": {"source": source, "credentialsSecret": "hf-token"}}), CONFIG)
    env = _pod_spec(api, "m")["initContainers"][0]["env"]
    assert [e["valueFrom"]["secretKeyRef"]["name"] for e in env] == ["hf-token"]
    reconcile(api, _isvc("m", {"model": {"source": source}}, 2), CONFIG)
    assert "env" not in _pod_spec(api, "m")["initContainers"][0]


def test_a_canonicalised_cache_size_is_not_reapplied():
    for cache in ("1.5Gi", "20480Mi"):
        api = ApiServer()
        body = _isvc("m", {"model": {"source": "/models/x.gguf", "cacheSize": cache}})
        reconcile(api, body, CONFIG)
        assert _pod_spec(api, "m")["volumes"][0]["emptyDir"]["sizeLimit"] == CANONICAL[cache]
        api.writes.clear()
        later = reconcile(api, body, CONFIG)
        assert ({r.action for r in later.applied}, api.writes) == ({"unchanged"}, [])
