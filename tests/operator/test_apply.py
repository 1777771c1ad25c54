"""Reconcile against an API server stand-in: removals roll out, canonical quantities are not drift,
children the API server would refuse or another owner holds are reported, never fought over."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e"))  # the harness package (read only)

from harness.patches import merge_patch  # RFC 7386, as the harness API server applies it

from kvpilot.operator import metrics
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.handlers import _reconcile_pass
from kvpilot.operator.kube_api import KubeApiError
from kvpilot.operator.reconcile import reconcile

CONFIG = OperatorConfig(default_image="img:1")
# What apimachinery's Quantity.String() makes of these (kube-apiserver stores the canonical form).
CANONICAL = {"1.5Gi": "1536Mi", "20480Mi": "20Gi"}


class ApiServer:
    """Objects by (kind, namespace, name): create, get, JSON merge patch; emptyDir sizes canonicalised."""

    def __init__(self, refuse: Callable[[dict[str, Any]], str | None] = lambda obj: None) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.writes: list[tuple[str, str, str]] = []
        self.refuse = refuse  # the API server's 422 message for an object, if it has one

    def _store(self, key: tuple[str, str, str], obj: dict[str, Any]) -> dict[str, Any]:
        if obj["kind"] != "Event" and (message := self.refuse(obj)) is not None:
            raise KubeApiError(422, "Invalid", message)
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
        if key in self.objects:
            raise KubeApiError(409, "AlreadyExists", f"{key} already exists")
        self.writes.append(("create", *key[::2]))
        return self._store(key, copy.deepcopy(obj))

    def merge_patch(self, ref: Any, patch: dict[str, Any], subresource: str = "") -> dict[str, Any]:
        key = (ref.kind, ref.namespace, ref.name)
        self.writes.append(("patch" + (f"/{subresource}" if subresource else ""), ref.kind, ref.name))
        if subresource:
            self.objects[key] = merge_patch(self.objects[key], patch)
            return copy.deepcopy(self.objects[key])
        return self._store(key, merge_patch(self.objects[key], patch))

    def list(self, ref: Any, label_selector: str) -> list[dict[str, Any]]:
        return []


RECONCILED: set[str] = set()


@pytest.fixture(autouse=True)
def _forget_series():
    """The operator's series live in one process-wide registry that other tests scrape: drop these."""
    yield
    for name in RECONCILED:
        metrics.forget("team", name)
    RECONCILED.clear()


def _isvc(name: str, spec: dict[str, Any], generation: int = 1) -> dict[str, Any]:
    RECONCILED.add(name)
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}", "generation": generation},
        "spec": spec,
    }


def _pod_spec(api: ApiServer, name: str) -> dict[str, Any]:
    return api.objects[("Deployment", "team", name)]["spec"]["template"]["spec"]


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


def _ready(status: dict[str, Any]) -> tuple[str, str, str]:
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    return ready["status"], ready["reason"], ready["message"]


def _events(api: ApiServer) -> list[tuple[str, str]]:
    return [(o["reason"], o["involvedObject"]["name"]) for k, o in api.objects.items() if k[0] == "Event"]


DNS1035 = (
    "a DNS-1035 label: at most 63 lowercase letters, digits or '-', starting with a letter and ending "
    "with a letter or digit"
)
LABEL = "a label value (at most 63 characters, alphanumeric at both ends, '-', '_' or '.' between)"
TOLERATIONS = "Deployment m: spec.template.spec.tolerations[0]"
REFUSED = [
    (
        "a" * 56,
        {},
        f"Service {'a' * 56}-engine: metadata.name: '{'a' * 56}-engines' (64 characters) is not {DNS1035}",
    ),
    ("llama.v2", {}, f"Service llama.v2-engines: metadata.name: 'llama.v2-engines' is not {DNS1035}"),
    ("7b-chat", {}, f"Service 7b-chat-engines: metadata.name: '7b-chat-engines' is not {DNS1035}"),
    (
        "m",
        {"resources": {"gpus": 1, "gpuType": "NVIDIA A100"}},
        "Deployment m: spec.template.spec.nodeSelector[nvidia.com/gpu.product]: 'NVIDIA A100' is not "
        + LABEL,
    ),
    (  # Python's $ also matches before a final newline; the API server's RE2 does not
        "m",
        {"resources": {"gpus": 1, "gpuType": "NVIDIA-A100\n"}},
        "Deployment m: spec.template.spec.nodeSelector[nvidia.com/gpu.product]: 'NVIDIA-A100\\n' is not "
        + LABEL,
    ),
    (
        "m",
        {"tenancy": {"nodeSelector": {"pool name": "x"}}},
        "Deployment m: spec.template.spec.nodeSelector: key 'pool name' is not a qualified name",
    ),
    (
        "m",
        {"tenancy": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}},
        f"{TOLERATIONS}.value: must be empty when the operator is 'Exists'",
    ),
    (
        "m",
        {"tenancy": {"tolerations": [{"key": "k", "effect": "NoSchedule", "tolerationSeconds": 5}]}},
        f"{TOLERATIONS}.effect: must be 'NoExecute' when tolerationSeconds is set",
    ),
    (
        "m",
        {"engine": {"image": "ghcr.io/x/y:1 "}},
        "Deployment m: spec.template.spec.containers[engine].image: 'ghcr.io/x/y:1 ' has surrounding spaces",
    ),
]


@pytest.mark.parametrize(("name", "extra", "first"), REFUSED, ids=[c[2][:40] for c in REFUSED])
def test_a_spec_whose_children_kubernetes_refuses_is_reported_before_any_child_is_written(name, extra, first):
    api = ApiServer()
    result = reconcile(api, _isvc(name, {"model": {"source": "tiny-random"}, **extra}), CONFIG)
    assert [kind for _, kind, _ in api.writes] == ["Event"]  # nothing partial left behind
    assert _events(api) == [("InvalidSpec", name)]
    status, reason, message = _ready(result.status_patch)
    assert (result.status_patch["phase"], status, reason) == ("Failed", "False", "InvalidSpec")
    assert message.split("; ")[0] == first


def test_a_child_the_api_server_refuses_is_reported_with_its_message_and_backed_off():
    def refuse(obj: dict[str, Any]) -> str | None:
        return 'Deployment "m" is invalid: spec.foo: Forbidden' if obj["kind"] == "Deployment" else None

    api, body = ApiServer(refuse), _isvc("m", {"model": {"source": "tiny-random"}})
    api.objects[("InferenceService", "team", "m")] = body
    blocked: dict[Any, tuple[int, int]] = {}
    delays = [_reconcile_pass(api, ("team", "m"), CONFIG, None, blocked) for _ in range(7)]  # type: ignore[arg-type]
    assert delays == [10.0, 20.0, 40.0, 80.0, 160.0, 300.0, 300.0]
    status = api.objects[("InferenceService", "team", "m")]["status"]
    assert _ready(status) == (
        "False",
        "ChildRejected",
        'Deployment m: refused by the API server: HTTP 422 Invalid: Deployment "m" is invalid: spec.foo: '
        "Forbidden",
    )
    assert _events(api) == [("ChildRejected", "m")]  # once, not once a pass
    # A new generation starts the back-off again; a pass that applies everything ends it.
    body["metadata"]["generation"] = 2
    assert _reconcile_pass(api, ("team", "m"), CONFIG, None, blocked) == 10.0  # type: ignore[arg-type]
    api.refuse = lambda obj: None
    assert _reconcile_pass(api, ("team", "m"), CONFIG, None, blocked) is None  # type: ignore[arg-type]
    assert _ready(api.objects[("InferenceService", "team", "m")]["status"])[1] != "ChildRejected"


def test_two_services_whose_child_names_meet_do_not_fight_over_the_object():
    # 'chat' owns the headless Service chat-engines; InferenceService 'chat-engines' wants its client
    # Service under the same name. The first owner keeps it; the second is told, and writes nothing to it.
    api = ApiServer()
    chat, other = _isvc("chat", {"model": {"source": "tiny-random"}}), _isvc("chat-engines", {"model": {}})
    other["spec"]["model"] = {"source": "smollm2-135m"}
    reconcile(api, chat, CONFIG)
    service = copy.deepcopy(api.objects[("Service", "team", "chat-engines")])
    api.writes.clear()
    for _ in range(3):
        result = reconcile(api, other, CONFIG)
        reconcile(api, chat, CONFIG)
    assert api.objects[("Service", "team", "chat-engines")] == service
    assert [w for w in api.writes if w[1] != "Event"] == [
        ("create", "ServiceAccount", "chat-engines-router"),
        ("create", "Role", "chat-engines-router"),
        ("create", "RoleBinding", "chat-engines-router"),
        ("create", "Secret", "chat-engines-router-token"),
        ("create", "Service", "chat-engines-engines"),
    ]  # and no Deployment for the service whose clients would reach the other model
    assert _ready(result.status_patch) == (
        "False",
        "ChildConflict",
        "Service chat-engines: an object of this name exists, controlled by InferenceService chat; left as "
        "it is",
    )
    assert result.blocked == "ChildConflict"


def test_a_users_own_object_is_never_taken_over_and_an_orphaned_child_is_adopted():
    api = ApiServer()
    user = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "team"}}
    user["spec"] = {"selector": {"app": "web"}, "ports": [{"port": 443}]}
    api.objects[("Service", "team", "web")] = copy.deepcopy(user)
    result = reconcile(api, _isvc("web", {"model": {"source": "tiny-random"}}), CONFIG)
    assert api.objects[("Service", "team", "web")] == user
    assert _ready(result.status_patch)[1:] == (
        "ChildConflict",
        "Service web: an object of this name exists, not created by the operator for this "
        "InferenceService (no owner reference, other labels); left as it is",
    )
    # Children left by an uninstall with orphan (owner references gone, labels kept) are taken back.
    api = ApiServer()
    body = _isvc("smol", {"model": {"source": "tiny-random"}})
    reconcile(api, body, CONFIG)
    for obj in api.objects.values():
        obj["metadata"].pop("ownerReferences", None)
    result = reconcile(api, body, CONFIG)
    owners = {o["metadata"]["ownerReferences"][0]["uid"] for k, o in api.objects.items() if k[0] != "Event"}
    assert (result.blocked, owners) == (None, {"uid-smol"})
