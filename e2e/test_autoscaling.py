"""End to end: elastic InferenceServices (docs/architecture.md#autoscaling) on the harness, real Kopf
and kubectl, fake pods: the scale subresource in autoscaling.mode external (kubectl scale, as an HPA or
KEDA writes it) and the operator's own autoscaler in mode operator, fed by the pods' /metrics."""

from __future__ import annotations

import json
import re
import sys
import time

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


def exposition(finished: float, attained: float, waiting: float = 0.0) -> str:
    return (
        "# TYPE kvpilot_requests_finished_total counter\n"
        f'kvpilot_requests_finished_total{{model_name="smol",finished_reason="stop"}} {finished}\n'
        "# TYPE kvpilot_slo_attained_requests_total counter\n"
        f'kvpilot_slo_attained_requests_total{{model_name="smol"}} {attained}\n'
        "# TYPE kvpilot_num_requests_waiting gauge\n"
        f'kvpilot_num_requests_waiting{{model_name="smol"}} {waiting}\n'
    )


class Load:
    """The fake engines' counters: the whole arrival rate lands on one pod (``pod``, which the test picks
    among those alive), so the total is the rate the test sets whatever the replica count."""

    def __init__(self) -> None:
        self.rate, self.total, self.since, self.pod = 0.0, 0.0, time.monotonic(), ""

    def set(self, rate: float) -> float:
        now = time.monotonic()
        self.total += self.rate * (now - self.since)
        self.rate, self.since = rate, now
        return now

    def metrics(self, pod: dict) -> str:
        if pod["metadata"]["name"] != self.pod:
            return exposition(0, 0)
        served = self.total + self.rate * (time.monotonic() - self.since)
        return exposition(served, served)


def test_operator_autoscaler_follows_a_load_step_up_and_back_down(cluster, kubectl, namespace):
    load = Load()
    cluster.runner.metrics = load.metrics
    spec = (
        "  scaling: {perReplicaGoodput: 2, headroom: 0, spare: 1, minReplicas: 1, maxReplicas: 5}\n"
        "  autoscaling: {mode: operator, intervalSeconds: 1, rateWindowSeconds: 2,\n"
        "    scaleDownStabilizationSeconds: 3, cooldownSeconds: 0}\n"
    )
    try:
        kubectl("apply", "-f", "-", stdin=manifest(namespace, "smol", spec))
        # No load: N 0 + spare 1 once the down window has passed.
        quiet = wait_ready(cluster, namespace, "smol", 1)
        assert (quiet["sizing"]["mode"], quiet["sizing"]["arrivalRate"]) == ("Autoscaler", 0.0)
        assert quiet["sizing"]["formula"] == "clamp(ceil(0 × (1 + 0) / 2) + 1, 1, 5) = 1"

        (alive,) = cluster.list("v1/pods", namespace)
        load.pod = alive["metadata"]["name"]
        step = load.set(6.0)  # 6 req/s at 2 per replica: N 3, + spare 1 = 4
        cluster.wait_for(
            "desired 4", lambda: status_of(cluster, namespace, "smol").get("desiredReplicas") == 4, timeout=30
        )
        decided = time.monotonic() - step
        busy = wait_ready(cluster, namespace, "smol", 4, timeout=30)
        ready = time.monotonic() - step
        # The rate window may still hold a moment before the step: any λ in (4, 6] gives N = 3.
        assert 4 < busy["sizing"]["arrivalRate"] <= 6.3, busy["sizing"]
        assert re.fullmatch(
            r"clamp\(ceil\([0-9.]+ × \(1 \+ 0\) / 2\) \+ 1, 1, 5\) = 4", busy["sizing"]["formula"]
        )
        assert (busy["sizing"]["serving"], busy["sizing"]["unclamped"]) == (3, 4)
        assert busy["sizing"]["goodputSource"] == "Spec"  # never saturated: the spec's goodput stands
        sys.stderr.write(f"\nload step -> desired 4: {decided:.1f} s, -> 4 Ready: {ready:.1f} s\n")

        load.set(0.0)
        back = wait_ready(cluster, namespace, "smol", 1, timeout=30)
        assert back["sizing"]["decision"] in ("ScaleDown", "Hold")
        events = json.loads(kubectl("get", "events", "-n", namespace, "-o", "json").stdout)["items"]
        reasons = [e["reason"] for e in events if e["involvedObject"]["name"] == "smol"]
        assert "ScaledUp" in reasons and "ScaledDown" in reasons
        up = next(e for e in events if e["reason"] == "ScaledUp" and "-> 4" in e["message"])
        assert up["involvedObject"]["kind"] == "InferenceService" and up["type"] == "Normal"
    finally:
        cluster.runner.metrics = None


def condition(status: dict, kind: str) -> tuple[str, str, str]:
    found = next(c for c in status["conditions"] if c["type"] == kind)
    return found["status"], found["reason"], found["message"]


def test_capacity_limited_no_spare_and_scaled_to_zero(cluster, kubectl, namespace):
    # N = 6 above maxReplicas 4, no spare: all 4 desired Ready, yet capacity-limited against N.
    kubectl(
        "apply",
        "-f",
        "-",
        stdin=manifest(namespace, "big", "  scaling: {replicas: 6, spare: 0, maxReplicas: 4}\n"),
    )
    status = wait_ready(cluster, namespace, "big", 4)
    assert (status["sizing"]["serving"], status["sizing"]["capacityLimited"]) == (6, True)
    assert condition(status, "CapacityLimited") == (
        "True",
        "MaxReplicasReached",
        "6 replicas needed to carry the load, scaling.maxReplicas is 4",
    )
    assert condition(status, "SpareAvailable")[:2] == ("False", "NoSpare")
    # A budget of 0 would block every drain: one at a time.
    assert cluster.get("policy/v1/poddisruptionbudgets", namespace, "big")["spec"]["maxUnavailable"] == 1

    # Nothing desired (target 0, minReplicas 0, no spare): Idle, not "Ready 0/0".
    zero = "  scaling: {targetRequestsPerSecond: 0, perReplicaGoodput: 1, spare: 0, minReplicas: 0}\n"
    kubectl("apply", "-f", "-", stdin=manifest(namespace, "idle", zero))
    idle = cluster.wait_for(
        "phase Idle", lambda: (s := status_of(cluster, namespace, "idle")).get("phase") == "Idle" and s
    )
    assert (idle["desiredReplicas"], idle["readyReplicas"]) == (0, 0)
    assert condition(idle, "Ready") == ("False", "ScaledToZero", "scaled to zero: no replica serves")
    table = kubectl("get", "kvis", "idle", "-n", namespace).stdout
    assert re.search(r"idle\s+smollm2-135m\s+0\s+0\s+Idle", table), table
