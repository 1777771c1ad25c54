"""End to end: elastic InferenceServices (docs/architecture.md#autoscaling) on the harness, real Kopf
and kubectl, fake pods: the scale subresource in autoscaling.mode external (kubectl scale, as an HPA or
KEDA writes it) and the operator's own autoscaler in mode operator, fed by the pods' /metrics."""

from __future__ import annotations

import json

import pytest
from harness.cluster import HarnessCluster

pytestmark = pytest.mark.e2e

ISVC = "kvpilot.dev/v1alpha1/inferenceservices"
DEPLOYMENTS = "apps/v1/deployments"


def manifest(namespace: str, name: str, spec: str) -> str:
    return (
        f"apiVersion: kvpilot.dev/v1alpha1\nkind: InferenceService\n"
        f"metadata: {{name: {name}, namespace: {namespace}}}\n"
        f"spec:\n  model: {{source: smollm2-135m, servedName: smol}}\n{spec}"
    )


def status_of(cluster: HarnessCluster, namespace: str, name: str) -> dict:
    return (cluster.get(ISVC, namespace, name) or {}).get("status", {})


def wait_ready(
    cluster: HarnessCluster, namespace: str, name: str, replicas: int, timeout: float = 60
) -> dict:
    return cluster.wait_for(
        f"Ready {replicas}/{replicas}",
        lambda: (
            (s := status_of(cluster, namespace, name)).get("phase") == "Ready"
            and s.get("readyReplicas") == replicas == s.get("desiredReplicas")
            and s
        ),
        timeout=timeout,
    )


def deployment_replicas(cluster: HarnessCluster, namespace: str, name: str) -> int:
    return cluster.get(DEPLOYMENTS, namespace, name)["spec"]["replicas"]


def test_kubectl_scale_in_external_mode_is_followed_and_not_fought(cluster, kubectl, namespace):
    spec = "  scaling: {replicas: 1}\n  autoscaling: {mode: external}\n"
    kubectl("apply", "-f", "-", stdin=manifest(namespace, "smol", spec))
    status = wait_ready(cluster, namespace, "smol", 2)  # spec.replicas unset: the static 1 + spare 1
    assert status["sizing"]["formula"] == "spec.replicas unset: clamp(1 + 1, 1, 100) = 2"

    out = kubectl("scale", "kvis/smol", "-n", namespace, "--replicas", "3").stdout
    assert "scaled" in out
    assert cluster.get(ISVC, namespace, "smol")["spec"]["replicas"] == 3
    status = wait_ready(cluster, namespace, "smol", 3)
    assert status["sizing"]["mode"] == "External"
    assert status["sizing"]["specReplicas"] == 3
    assert status["sizing"]["formula"] == "spec.replicas = 3 (autoscaling.mode external)"
    assert deployment_replicas(cluster, namespace, "smol") == 3

    # The Scale an HPA reads: current replicas from status.replicas, the pods by status.selector.
    raw = kubectl(
        "get", "--raw", f"/apis/kvpilot.dev/v1alpha1/namespaces/{namespace}/inferenceservices/smol/scale"
    ).stdout
    scale = json.loads(raw)
    assert (scale["kind"], scale["spec"]["replicas"], scale["status"]["replicas"]) == ("Scale", 3, 3)
    assert scale["status"]["selector"] == "kvpilot.dev/inferenceservice=smol"

    # A later pass (here: a watch event on the Deployment; every pass reads the token Secret) keeps the
    # scaled count: no fight.
    def secret_reads() -> int:
        path = f"/namespaces/{namespace}/secrets/smol-router-token"
        return sum(1 for r in cluster.api if r.method.value == "GET" and r.url.path.endswith(path))

    before = secret_reads()
    kubectl("annotate", "deployment", "smol", "-n", namespace, "e2e/touched=1")
    cluster.wait_for("a reconcile after the annotation", lambda: secret_reads() > before)
    assert deployment_replicas(cluster, namespace, "smol") == 3
    kubectl("scale", "kvis/smol", "-n", namespace, "--replicas", "1")
    wait_ready(cluster, namespace, "smol", 1)
    assert deployment_replicas(cluster, namespace, "smol") == 1
    replica_counts = [d["spec"]["replicas"] for d in cluster.history(DEPLOYMENTS, namespace, "smol")]
    # Every Deployment version follows spec.replicas as it was set: 2, then 3, then 1, never back.
    assert [n for i, n in enumerate(replica_counts) if i == 0 or n != replica_counts[i - 1]] == [2, 3, 1]
