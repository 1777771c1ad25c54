"""End to end: kubectl → harness API server ← kvpilot operator (Kopf), with the fake pod lifecycle."""

from __future__ import annotations

import base64
import json
import re
import time

import pytest
from harness.cluster import HarnessCluster

pytestmark = pytest.mark.e2e

ISVC = "kvpilot.dev/v1alpha1/inferenceservices"
DEPLOYMENTS = "apps/v1/deployments"


def manifest(namespace: str, name: str, scaling: str, extra: str = "") -> str:
    return (
        f"apiVersion: kvpilot.dev/v1alpha1\nkind: InferenceService\n"
        f"metadata: {{name: {name}, namespace: {namespace}}}\n"
        f"spec:\n  model: {{source: smollm2-135m, servedName: smol}}\n  scaling: {scaling}\n{extra}"
    )


def status_of(cluster: HarnessCluster, namespace: str, name: str) -> dict:
    return (cluster.get(ISVC, namespace, name) or {}).get("status", {})


def wait_phase(cluster: HarnessCluster, namespace: str, name: str, phase: str, timeout: float = 60) -> dict:
    return cluster.wait_for(
        f"phase {phase}",
        lambda: (s := status_of(cluster, namespace, name)).get("phase") == phase and s,
        timeout=timeout,
    )


def reconcile_passes(cluster: HarnessCluster, kubectl, namespace: str, passes: int) -> None:
    """Make the operator reconcile ``smol`` ``passes`` more times, each by a watch event (an annotation on
    its Deployment, which no reconcile reverts: the operator manages only the fields it set), and wait for
    each pass: every one reads the router token Secret."""

    def secret_reads() -> int:
        return sum(
            1
            for r in cluster.api
            if r.method.value == "GET"
            and r.url.path.endswith(f"/namespaces/{namespace}/secrets/smol-router-token")
        )

    for number in range(passes):
        before = secret_reads()
        kubectl("annotate", "deployment", "smol", "-n", namespace, "--overwrite", f"e2e/touched={number}")
        cluster.wait_for(f"reconcile pass {number + 1}", lambda before=before: secret_reads() > before)


def test_apply_creates_owned_children_and_becomes_ready(cluster, kubectl, namespace):
    kubectl("apply", "-f", "-", stdin=manifest(namespace, "smol", "{replicas: 2}"))
    status = wait_phase(cluster, namespace, "smol", "Ready")
    assert (status["desiredReplicas"], status["readyReplicas"], status["replicas"]) == (3, 3, 3)
    assert status["sizing"]["formula"] == "clamp(2 + 1, 1, 100) = 3"
    assert status["endpoint"] == f"http://smol.{namespace}.svc.cluster.local"
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "ReplicasReady")
    assert status["coldStart"]["samples"] == 3

    isvc_uid = cluster.get(ISVC, namespace, "smol")["metadata"]["uid"]
    children = {
        ("apps/v1/deployments", "smol"),
        ("v1/services", "smol"),
        ("v1/services", "smol-engines"),
        ("policy/v1/poddisruptionbudgets", "smol"),
        ("v1/serviceaccounts", "smol-router"),
        ("rbac.authorization.k8s.io/v1/roles", "smol-router"),
        ("rbac.authorization.k8s.io/v1/rolebindings", "smol-router"),
        ("v1/secrets", "smol-router-token"),
    }
    for resource, name in children:
        owners = cluster.get(resource, namespace, name)["metadata"]["ownerReferences"]
        assert [(o["kind"], o["uid"], o["controller"]) for o in owners] == [
            ("InferenceService", isvc_uid, True)
        ]

    deployment = json.loads(kubectl("get", "deployment", "smol", "-n", namespace, "-o", "json").stdout)
    engine, router = deployment["spec"]["template"]["spec"]["containers"]
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}
    assert engine["args"][:6] == ["--model", "smollm2-135m", "--port", "8000", "--served-model-name", "smol"]
    assert router["args"] == [
        "--model",
        "smollm2-135m",
        "--port",
        "8080",
        "--endpointslices",
        "smol-engines",
        "--namespace",
        namespace,
        "--policy",
        "cache_aware",
    ]
    assert cluster.get("policy/v1/poddisruptionbudgets", namespace, "smol")["spec"]["maxUnavailable"] == 1

    table = kubectl("get", "kvis", "-n", namespace).stdout.splitlines()
    assert table[0].split() == ["NAME", "MODEL", "DESIRED", "READY", "PHASE", "AGE"]
    assert table[1].split()[:5] == ["smol", "smollm2-135m", "3", "3", "Ready"]


def test_a_router_token_secret_is_created_once_and_referenced_by_both_containers(cluster, kubectl, namespace):
    """Security (issue 26 item 1): the per-service token the router presents to the engines."""
    kubectl("apply", "-f", "-", stdin=manifest(namespace, "smol", "{replicas: 1}"))
    wait_phase(cluster, namespace, "smol", "Ready")
    secret = json.loads(kubectl("get", "secret", "smol-router-token", "-n", namespace, "-o", "json").stdout)
    isvc_uid = cluster.get(ISVC, namespace, "smol")["metadata"]["uid"]
    assert [(o["kind"], o["uid"], o["controller"]) for o in secret["metadata"]["ownerReferences"]] == [
        ("InferenceService", isvc_uid, True)
    ]
    assert secret["metadata"]["labels"]["kvpilot.dev/inferenceservice"] == "smol"
    assert secret["type"] == "Opaque" and list(secret["data"]) == ["token"]
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert re.fullmatch(r"[0-9a-f]{64}", token)

    template = cluster.get(DEPLOYMENTS, namespace, "smol")["spec"]["template"]["spec"]
    reference = {
        "name": "KVPILOT_ROUTER_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "smol-router-token", "key": "token"}},
    }
    for container in template["containers"]:
        assert reference in container["env"], container["name"]

    # Later reconciles never rewrite it: one stored version, the same token.
    reconcile_passes(cluster, kubectl, namespace, 3)
    assert len(cluster.history("v1/secrets", namespace, "smol-router-token")) == 1
    assert cluster.get("v1/secrets", namespace, "smol-router-token")["data"] == secret["data"]


def test_scaling_change_resizes_by_the_n_plus_one_rule(cluster, kubectl, namespace):
    rate = "{{targetRequestsPerSecond: {}, perReplicaGoodput: 4, headroom: 0.2}}"
    kubectl("apply", "-f", "-", stdin=manifest(namespace, "smol", rate.format(10)))
    status = wait_phase(cluster, namespace, "smol", "Ready")
    assert status["sizing"]["desiredReplicas"] == 4  # ceil(10 × 1.2 / 4) = 3, + 1 spare
    kubectl("apply", "-f", "-", stdin=manifest(namespace, "smol", rate.format(20)))
    cluster.wait_for(
        "7 replicas", lambda: cluster.get(DEPLOYMENTS, namespace, "smol")["spec"]["replicas"] == 7
    )
    # the status of generation 1 still says Ready until the operator has seen the change
    status = cluster.wait_for(
        "generation 2 Ready",
        lambda: (
            (s := status_of(cluster, namespace, "smol")).get("observedGeneration") == 2
            and s["phase"] == "Ready"
            and s
        ),
        timeout=60,
    )
    assert status["sizing"]["formula"] == "clamp(ceil(20 × (1 + 0.2) / 4) + 1, 1, 100) = 7"
    assert (status["readyReplicas"], status["observedGeneration"]) == (7, 2)


def test_rollout_never_drops_below_the_serving_replicas(cluster, kubectl, namespace):
    kubectl("apply", "-f", "-", stdin=manifest(namespace, "smol", "{replicas: 3}"))
    wait_phase(cluster, namespace, "smol", "Ready")
    start = len(cluster.history("v1/pods", namespace, ""))  # nothing: pods are keyed by name
    kubectl(
        "apply", "-f", "-", stdin=manifest(namespace, "smol", "{replicas: 3}", "  engine: {maxNumSeqs: 32}\n")
    )
    lowest = 4

    def rolled() -> bool:
        nonlocal lowest
        pods = cluster.list("v1/pods", namespace)
        ready = sum(
            any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in p.get("status", {}).get("conditions", [])
            )
            for p in pods
        )
        lowest = min(lowest, ready)
        args = [p["spec"]["containers"][0]["args"] for p in pods]
        return len(pods) == 4 and all("32" in a for a in args) and ready == 4

    cluster.wait_for("the new template on every pod", rolled, timeout=30, interval=0.05)
    assert start == 0 and lowest >= 3  # at most the one spare replica was ever down


def test_invalid_specs_are_refused_or_reported(cluster, kubectl, namespace):
    refused = kubectl(
        "apply", "-f", "-", check=False, stdin=manifest(namespace, "bad", "{replicas: 2, spare: -1}")
    )
    assert refused.returncode != 0
    assert "spec.scaling.spare" in refused.stderr
    assert cluster.get(ISVC, namespace, "bad") is None
    # A replica's GPUs are one node's, split by tensor parallelism: the CRD's maximum (8) refuses more.
    refused = kubectl(
        "apply",
        "-f",
        "-",
        check=False,
        stdin=manifest(namespace, "tp", "{replicas: 1}", "  resources: {gpus: 9}\n"),
    )
    assert refused.returncode != 0
    assert "spec.resources.gpus" in refused.stderr
    assert cluster.get(ISVC, namespace, "tp") is None
    # Both sizing forms at once: a CEL rule on a real cluster; the harness has no CEL, so the operator
    # reports.
    kubectl(
        "apply",
        "-f",
        "-",
        stdin=manifest(namespace, "both", "{replicas: 2, targetRequestsPerSecond: 5, perReplicaGoodput: 1}"),
    )
    status = wait_phase(cluster, namespace, "both", "Failed")
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert ready["message"] == (
        "spec.scaling.replicas: set either scaling.replicas or scaling.targetRequestsPerSecond, not both"
    )
    assert cluster.get(DEPLOYMENTS, namespace, "both") is None


def test_phases_follow_warm_up_and_failures(cluster, kubectl, namespace):
    cluster.runner.namespace_stages[namespace] = "loading"
    kubectl("apply", "-f", "-", stdin=manifest(namespace, "smol", "{replicas: 1}"))
    status = wait_phase(cluster, namespace, "smol", "Loading")
    assert status["engines"]["loading"] == 2
    assert "engine loading (40%)" not in status["conditions"][0]["message"]  # the message summarizes counts
    cluster.runner.namespace_stages[namespace] = "warmingUp"
    assert wait_phase(cluster, namespace, "smol", "WarmingUp")["engines"]["warmingUp"] == 2
    cluster.runner.namespace_stages[namespace] = "ready"
    wait_phase(cluster, namespace, "smol", "Ready")
    pods = cluster.list("v1/pods", namespace)
    cluster.runner.stages[pods[0]["metadata"]["name"]] = "crashing"
    status = wait_phase(cluster, namespace, "smol", "Degraded")
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and "CrashLoopBackOff" in degraded["message"]
    cluster.runner.stages[pods[1]["metadata"]["name"]] = "crashing"
    wait_phase(cluster, namespace, "smol", "Failed")


def test_reconcile_is_idempotent_and_reverts_manual_edits(cluster, kubectl, namespace):
    kubectl("apply", "-f", "-", stdin=manifest(namespace, "smol", "{replicas: 1}"))
    wait_phase(cluster, namespace, "smol", "Ready")

    def operator_writes() -> int:
        return sum(
            1
            for r in cluster.api
            if r.method.value in ("POST", "PATCH", "PUT")
            and f"/namespaces/{namespace}/" in r.url.path
            and "/inferenceservices/" not in r.url.path
        )

    before = operator_writes()
    reconcile_passes(cluster, kubectl, namespace, 3)
    kubectl_writes = 3  # the annotations themselves
    assert operator_writes() == before + kubectl_writes  # reconciles without a single write to any child

    kubectl(
        "patch",
        "deployment",
        "smol",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"spec": {"replicas": 5, "template": {"spec": {"terminationGracePeriodSeconds": 1}}}}',
    )
    kubectl("label", "service", "smol", "-n", namespace, "--overwrite", "app.kubernetes.io/instance=other")
    cluster.wait_for(
        "the managed fields put back",
        lambda: (
            (d := cluster.get(DEPLOYMENTS, namespace, "smol"))["spec"]["replicas"] == 2
            and d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 120
            and cluster.get("v1/services", namespace, "smol")["metadata"]["labels"][
                "app.kubernetes.io/instance"
            ]
            == "smol"
        ),
    )


def test_delete_removes_every_child(cluster, kubectl, namespace):
    kubectl("apply", "-f", "-", stdin=manifest(namespace, "smol", "{replicas: 1}"))
    wait_phase(cluster, namespace, "smol", "Ready")
    started = time.monotonic()
    kubectl("delete", "inferenceservice", "smol", "-n", namespace)  # waits until the object is gone
    # Kopf holds its finalizer until the refresh timer stops; one caught mid-reconcile used to keep it
    # for Kopf's default 60 s re-check (operator.handlers.TIMER_EXIT_POLL_SECONDS)
    assert time.monotonic() - started < 15
    for resource in (
        "apps/v1/deployments",
        "v1/services",
        "v1/pods",
        "policy/v1/poddisruptionbudgets",
        "v1/serviceaccounts",
        "rbac.authorization.k8s.io/v1/roles",
        "v1/secrets",
    ):
        cluster.wait_for(f"no {resource}", lambda resource=resource: not cluster.list(resource, namespace))


def test_a_dependent_created_after_its_owner_is_gone_is_collected(cluster, kubectl, namespace):
    """The race behind a lingering child: a controller creates a dependent just after its owner's deletion
    (and its garbage collection) ran. The harness, like the real collector, deletes the dangling dependent;
    one whose owner still lives stays."""
    import kmock

    configmaps = kmock.resource("", "v1", "configmaps")
    owner = cluster.call(cluster.api.create(configmaps, namespace, {"metadata": {"name": "owner"}}))

    def dependent(name: str, uid: str) -> dict:
        return {
            "metadata": {
                "name": name,
                "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}],
            }
        }

    cluster.call(cluster.api.create(configmaps, namespace, dependent("kept", owner["metadata"]["uid"])))
    cluster.call(cluster.api.create(configmaps, namespace, dependent("dangling", "uid-of-a-deleted-owner")))
    assert sorted(cm["metadata"]["name"] for cm in cluster.list("v1/configmaps", namespace)) == [
        "kept",
        "owner",
    ]


def test_deleted_and_edited_children_are_restored_by_the_watch_not_the_resync(cluster, kubectl, namespace):
    """The operator here resyncs every 10 minutes (conftest.py): a child put back within seconds was put
    back because its watch event triggered a reconcile."""
    kubectl("apply", "-f", "-", stdin=manifest(namespace, "smol", "{replicas: 1}"))
    wait_phase(cluster, namespace, "smol", "Ready")
    for resource, kind, name in (
        (DEPLOYMENTS, "deployment", "smol"),
        ("v1/services", "service", "smol-engines"),
        ("policy/v1/poddisruptionbudgets", "poddisruptionbudget", "smol"),
    ):
        uid = cluster.get(resource, namespace, name)["metadata"]["uid"]
        kubectl("delete", kind, name, "-n", namespace)
        cluster.wait_for(
            f"{kind} {name} re-created",
            lambda resource=resource, name=name, uid=uid: (
                (found := cluster.get(resource, namespace, name)) and found["metadata"]["uid"] != uid
            ),
            timeout=10,
        )
    kubectl(
        "patch",
        "poddisruptionbudget",
        "smol",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"spec": {"maxUnavailable": 0}}',
    )
    cluster.wait_for(
        "the PodDisruptionBudget's maxUnavailable put back",
        lambda: (
            cluster.get("policy/v1/poddisruptionbudgets", namespace, "smol")["spec"]["maxUnavailable"] == 1
        ),
        timeout=10,
    )
    # and a pod change reaches the status through the pod watch
    pod = cluster.list("v1/pods", namespace)[0]["metadata"]["name"]
    cluster.runner.stages[pod] = "crashing"
    wait_phase(cluster, namespace, "smol", "Degraded", timeout=10)


def test_a_ready_service_is_left_alone_between_resyncs(cluster, kubectl, namespace):
    """No polling: once Ready, nothing is asked of the API server about the service (it used to cost ~9
    requests per status interval); the figure per service and minute comes from e2e/api_calls.py."""
    kubectl("apply", "-f", "-", stdin=manifest(namespace, "smol", "{replicas: 2}"))
    wait_phase(cluster, namespace, "smol", "Ready")
    quiet_s = 3.0
    seen = {"count": -1, "since": 0.0}

    def quiet() -> bool:
        count = sum(1 for r in cluster.api if f"/namespaces/{namespace}/" in r.url.path)
        if count != seen["count"]:
            seen.update(count=count, since=time.monotonic())
        return time.monotonic() - seen["since"] >= quiet_s

    cluster.wait_for(f"{quiet_s:g} s without a request about {namespace}", quiet, timeout=20)
