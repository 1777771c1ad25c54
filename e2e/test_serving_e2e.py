"""End to end with real processes: kubectl → operator → Deployment → the process kubelet runs every pod's
``kvpilot serve`` engine and ``kvpilot router`` sidecar → an OpenAI request through a router is served.

The cluster here runs ``ProcessPodRunner``: pod readiness comes from the containers' own probes with the
operator's real probe timing (startup probe every 10 s, readiness every 5 s), so each replica takes one
startup-probe period or two to turn Ready. The tiny seeded model, a 1 MiB KV cache and one small warm-up
pass keep each engine's start to a few seconds of CPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import openai
import pytest
from harness.cluster import HarnessCluster
from harness.process_cluster import process_cluster
from harness.process_runner import ProcessPodRunner

pytestmark = pytest.mark.e2e

ISVC = "kvpilot.dev/v1alpha1/inferenceservices"
NAME = "tiny"
ENGINE_PORT, ROUTER_PORT = 8000, 8080
# A replica is Ready one or two startup-probe periods (10 s) after its pod starts on a quiet machine; the
# rest is slack for a machine whose two cores are shared with other work (a bound, not the expected time).
READY_TIMEOUT_S = 90


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HarnessCluster]:
    """A harness cluster whose kubelet runs real processes (replaces conftest's fake-pod cluster here)."""
    with process_cluster(tmp_path_factory.mktemp("serving")) as harness:
        yield harness


def manifest(namespace: str, replicas: int) -> str:
    return (
        f"apiVersion: kvpilot.dev/v1alpha1\nkind: InferenceService\n"
        f"metadata: {{name: {NAME}, namespace: {namespace}}}\n"
        f"spec:\n"
        f"  model: {{source: tiny-random, servedName: {NAME}}}\n"
        f"  engine: {{kvCacheMemory: 1Mi, extraArgs: ['--warmup-buckets', '1x8']}}\n"
        f"  scaling: {{replicas: {replicas}}}\n"
    )


def ready_status(cluster: HarnessCluster, namespace: str, replicas: int) -> dict:
    def ready() -> dict | None:
        status = (cluster.get(ISVC, namespace, NAME) or {}).get("status", {})
        done = status.get("phase") == "Ready" and status.get("readyReplicas") == replicas
        return status if done else None

    return cluster.wait_for(f"{NAME} Ready with {replicas} ready replicas", ready, timeout=READY_TIMEOUT_S)


def pod_processes(pod: dict) -> dict[str, int]:
    """Container name -> PID, from the containerIDs (``process://<pid>``) the process kubelet reports."""
    return {
        c["name"]: int(c["containerID"].removeprefix("process://"))
        for c in pod["status"]["containerStatuses"]
    }


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def group_alive(pid: int) -> bool:
    """Whether anything is left in the process group the container's main process led."""
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def assert_serving_pod(pod: dict) -> None:
    status = pod["status"]
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert (status["phase"], conditions["Ready"], conditions["ContainersReady"]) == (
        "Running",
        "True",
        "True",
    )
    for container in status["containerStatuses"]:
        assert (container["started"], container["ready"], container["restartCount"]) == (True, True, 0), (
            container
        )
        assert "running" in container["state"]
    assert all(alive(pid) for pid in pod_processes(pod).values())


def router_url(cluster: HarnessCluster, namespace: str) -> str:
    """A ready endpoint of the client Service ``<name>`` (port 80 → router 8080), as kube-proxy would pick."""
    endpoints = cluster.get("discovery.k8s.io/v1/endpointslices", namespace, f"{NAME}-harness")["endpoints"]
    address = next(e["addresses"][0] for e in endpoints if e["conditions"]["ready"])
    return f"http://{address}:{ROUTER_PORT}"


def test_inference_service_serves_completions_from_real_processes(cluster, kubectl, namespace):
    runner: ProcessPodRunner = cluster.runner
    kubectl("apply", "-f", "-", stdin=manifest(namespace, replicas=1))
    status = ready_status(cluster, namespace, replicas=2)  # 1 replica + 1 spare
    assert (status["desiredReplicas"], status["replicas"]) == (2, 2)
    table = kubectl("get", "kvis", "-n", namespace).stdout.splitlines()
    assert table[0].split() == ["NAME", "MODEL", "DESIRED", "READY", "PHASE", "AGE"]
    assert table[1].split()[:5] == [NAME, "tiny-random", "2", "2", "Ready"]

    pods = cluster.list("v1/pods", namespace)
    for pod in pods:
        assert_serving_pod(pod)
    engines = {pod["metadata"]["name"] for pod in pods}  # the router names replicas by pod, not address

    router = router_url(cluster, namespace)
    client = openai.OpenAI(base_url=f"{router}/v1", api_key="unused", max_retries=0, timeout=30)
    response = client.completions.with_raw_response.create(
        model=NAME, prompt="The kubelet starts", max_tokens=6, temperature=0
    )
    completion = response.parse()
    assert completion.model == NAME and completion.usage.completion_tokens > 0
    assert completion.choices[0].finish_reason in ("length", "stop")
    assert response.headers["x-kvpilot-replica"] in engines

    kubectl("apply", "-f", "-", stdin=manifest(namespace, replicas=2))
    status = ready_status(cluster, namespace, replicas=3)
    assert (status["desiredReplicas"], status["replicas"], status["observedGeneration"]) == (3, 3, 2)
    pods = cluster.list("v1/pods", namespace)
    for pod in pods:
        assert_serving_pod(pod)
    added = [pod for pod in pods if pod["metadata"]["name"] not in engines]
    assert len(added) == 1
    # Every router found the new engine through its EndpointSlice watch (via the harness kubeconfig).
    routers = [f"http://{pod['status']['podIP']}:{ROUTER_PORT}" for pod in pods]
    cluster.wait_for(
        "every router routing to 3 engines",
        lambda: all(httpx.get(f"{url}/ready", timeout=5).json()["routable"] == 3 for url in routers),
        timeout=10,
    )

    containers = runner.containers(namespace)
    pids = [pid for container in containers for pid in container.pids]
    assert len(pids) == 6 and all(alive(pid) for pid in pids)  # 3 pods × (engine, router), none restarted
    kubectl("delete", "inferenceservice", NAME, "-n", namespace)
    for resource in ("apps/v1/deployments", "v1/pods", "v1/services"):
        cluster.wait_for(f"no {resource}", lambda resource=resource: not cluster.list(resource, namespace))
    # SIGTERM, then the engines drain (nothing in flight) and exit; nothing of any container group is left.
    cluster.wait_for(
        "every container process gone",
        lambda: not any(alive(pid) or group_alive(pid) for pid in pids),
        timeout=20,
    )
    exits = {(c.pod_name, c.name): c.state.get("terminated", {}).get("exitCode") for c in containers}
    assert set(exits.values()) == {0}, exits  # each stopped on SIGTERM by itself, none needed the SIGKILL
