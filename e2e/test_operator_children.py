"""End to end: children Kubernetes refuses, and children of a name another owner holds, are reported."""

from __future__ import annotations

import pytest
from harness.cluster import HarnessCluster

pytestmark = pytest.mark.e2e

ISVC = "kvpilot.dev/v1alpha1/inferenceservices"
SERVICES = "v1/services"


def manifest(namespace: str, name: str, extra: str = "") -> str:
    return (
        f"apiVersion: kvpilot.dev/v1alpha1\nkind: InferenceService\n"
        f"metadata: {{name: {name}, namespace: {namespace}}}\n"
        f"spec:\n  model: {{source: tiny-random}}\n  scaling: {{replicas: 1, spare: 0}}\n{extra}"
    )


def ready_condition(cluster: HarnessCluster, namespace: str, name: str, reason: str) -> dict:
    def found() -> dict | None:
        conditions = ((cluster.get(ISVC, namespace, name) or {}).get("status") or {}).get("conditions", [])
        ready = next((c for c in conditions if c["type"] == "Ready"), None)
        return ready if ready is not None and ready["reason"] == reason else None

    return cluster.wait_for(f"{name}: Ready reason {reason}", found, timeout=30)


def test_the_api_server_refuses_what_the_operator_reports_before_writing_any_child(
    cluster, kubectl, namespace
):
    # The harness refuses, as kube-apiserver does, a Service whose name is no DNS-1035 label ...
    service = f"apiVersion: v1\nkind: Service\nmetadata: {{name: llama.v2, namespace: {namespace}}}\n"
    refused = kubectl("apply", "-f", "-", check=False, stdin=service + "spec: {ports: [{port: 80}]}\n")
    assert refused.returncode != 0 and "metadata.name" in refused.stderr and "DNS-1035" in refused.stderr
    # ... so an InferenceService of that name (legal for a custom resource) is reported, not retried.
    kubectl("apply", "-f", "-", stdin=manifest(namespace, "llama.v2"))
    ready = ready_condition(cluster, namespace, "llama.v2", "InvalidSpec")
    assert ready["status"] == "False"
    assert ready["message"].startswith("Service llama.v2-engines: metadata.name: 'llama.v2-engines' is not")
    gpu = "  resources: {gpus: 1, gpuType: NVIDIA A100}\n"
    kubectl("apply", "-f", "-", stdin=manifest(namespace, "gpu", gpu))
    ready = ready_condition(cluster, namespace, "gpu", "InvalidSpec")
    assert ready["message"].startswith(
        "Deployment gpu: spec.template.spec.nodeSelector[nvidia.com/gpu.product]: 'NVIDIA A100' is not"
    )
    writes = [
        r.url.path
        for r in cluster.api
        if r.method.value == "POST"
        and f"/namespaces/{namespace}/" in r.url.path
        and "events" not in r.url.path
    ]
    assert [w.rsplit("/", 1)[1] for w in writes if "inferenceservices" not in w] == ["services"]  # kubectl's
    reasons = {e["reason"] for e in cluster.list("v1/events", namespace)}
    assert reasons == {"InvalidSpec"}


def test_two_services_whose_child_names_meet_do_not_fight_over_the_object(cluster, kubectl, namespace):
    # chat's headless Service is chat-engines; InferenceService chat-engines wants its client Service there.
    kubectl("apply", "-f", "-", stdin=manifest(namespace, "chat"))
    cluster.wait_for("chat's Deployment", lambda: cluster.get("apps/v1/deployments", namespace, "chat"))
    kubectl("apply", "-f", "-", stdin=manifest(namespace, "chat-engines"))
    ready = ready_condition(cluster, namespace, "chat-engines", "ChildConflict")
    assert ready["message"] == (
        "Service chat-engines: an object of this name exists, controlled by InferenceService chat; left as "
        "it is"
    )
    versions = [v for v in cluster.history(SERVICES, namespace, "chat-engines") if v]
    assert {(v["spec"]["clusterIP"], v["metadata"]["ownerReferences"][0]["name"]) for v in versions} == {
        ("None", "chat")
    }
    assert cluster.get("apps/v1/deployments", namespace, "chat-engines") is None
    # A user's own Service is never taken over either.
    user = f"apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: {namespace}}}\n"
    kubectl("apply", "-f", "-", stdin=user + "spec: {selector: {app: web}, ports: [{port: 443}]}\n")
    kubectl("apply", "-f", "-", stdin=manifest(namespace, "web"))
    ready_condition(cluster, namespace, "web", "ChildConflict")
    web = cluster.get(SERVICES, namespace, "web")
    assert (web["spec"]["selector"], web["metadata"].get("ownerReferences")) == ({"app": "web"}, None)
