"""End to end with real processes: scale to zero and back (docs/architecture.md#scale-to-zero).

An InferenceService with ``minReplicas: 0`` goes idle and to zero replicas; its client Service then points
at the activator (``kvpilot operator activator``, a process here like any container). Twenty concurrent
requests arriving at zero are held, the autoscaler sees them in the activator's ``/metrics`` and scales
to one, and every one is answered once the replica (a real engine and router) is Ready; the time to
first byte of those requests is the cold-start TTFT the activator reports apart. With no more requests
the service goes back to zero. Slow: one engine cold start.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from harness.cluster import HarnessCluster
from harness.process_cluster import process_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ISVC = "kvpilot.dev/v1alpha1/inferenceservices"
NAME = "tiny"
TIMEOUT_S = 240

MANIFEST = """\
apiVersion: kvpilot.dev/v1alpha1
kind: InferenceService
metadata: {{name: tiny, namespace: {namespace}}}
spec:
  model: {{source: tiny-random, servedName: tiny}}
  engine: {{kvCacheMemory: 1Mi, extraArgs: ['--warmup-buckets', '1x8']}}
  scaling: {{perReplicaGoodput: 5, spare: 0, minReplicas: 0, maxReplicas: 2}}
  autoscaling: {{mode: operator, intervalSeconds: 1, rateWindowSeconds: 4, scaleDownStabilizationSeconds: 2,
    cooldownSeconds: 0, idleTimeoutSeconds: 8, activatorHoldSeconds: 240}}
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HarnessCluster]:
    with process_cluster(tmp_path_factory.mktemp("scale-to-zero")) as harness:
        yield harness


def status_of(cluster: HarnessCluster, namespace: str) -> dict:
    return (cluster.get(ISVC, namespace, NAME) or {}).get("status", {})


def client_endpoint(cluster: HarnessCluster, namespace: str) -> tuple[str, str] | None:
    """(pod name, URL) of the one ready endpoint of the client Service, as kube-proxy would pick it."""
    slice_ = cluster.get("discovery.k8s.io/v1/endpointslices", namespace, f"{NAME}-harness") or {}
    ready = [e for e in slice_.get("endpoints", []) if e["conditions"]["ready"]]
    if len(ready) != 1:
        return None
    return ready[0]["targetRef"]["name"], f"http://{ready[0]['addresses'][0]}:8080"


def wait_idle_at_the_activator(cluster: HarnessCluster, namespace: str) -> str:
    def idle() -> str | None:
        status = status_of(cluster, namespace)
        pods = cluster.list("v1/pods", namespace)
        replicas = [p for p in pods if "kvpilot.dev/inferenceservice" in p["metadata"]["labels"]]
        if status.get("phase") != "Idle" or status.get("readyReplicas") != 0 or replicas:
            return None
        endpoint = client_endpoint(cluster, namespace)
        return endpoint[1] if endpoint and endpoint[0].startswith(f"{NAME}-activator") else None

    return cluster.wait_for("Idle, no replica, the Service at the activator", idle, timeout=TIMEOUT_S)


def test_requests_at_zero_are_held_and_answered_and_idle_goes_back_to_zero(cluster, kubectl, namespace):
    kubectl("apply", "-f", "-", stdin=MANIFEST.format(namespace=namespace))
    activator = wait_idle_at_the_activator(cluster, namespace)
    idle = status_of(cluster, namespace)
    assert (idle["desiredReplicas"], idle["readyReplicas"]) == (0, 0)
    assert next(c for c in idle["conditions"] if c["type"] == "Ready")["reason"] == "ScaledToZero"

    results: list[tuple[int, float]] = []
    lock = threading.Lock()
    start = time.monotonic()

    def one(index: int) -> None:
        body = {"model": NAME, "prompt": f"cold request {index}", "max_tokens": 4}
        try:
            with httpx.stream(
                "POST", f"{activator}/v1/completions", json=body, timeout=TIMEOUT_S
            ) as response:
                first = None
                for _ in response.iter_bytes():
                    first = first or time.monotonic() - start
                outcome = response.status_code
        except httpx.HTTPError as error:
            outcome, first = repr(error), None
        with lock:
            results.append((outcome, first if first is not None else -1.0))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S + 30)
    woke = status_of(cluster, namespace)
    assert [outcome for outcome, _ in results] == [200] * 20, results
    ttfts = sorted(first for _, first in results)
    sys.stderr.write(
        f"\nscale from zero: 20 held requests answered; TTFT min {ttfts[0]:.1f} s, "
        f"median {statistics.median(ttfts):.1f} s, max {ttfts[-1]:.1f} s\n"
    )
    assert woke["sizing"]["mode"] == "Autoscaler"
    metrics = httpx.get(f"{activator}/metrics", timeout=5).text
    assert "kvpilot_activator_held_total 20.0" in metrics
    assert "kvpilot_activator_cold_start_ttft_seconds_count 20.0" in metrics

    # No more requests: idle again after idleTimeoutSeconds + the down window, back at the activator.
    wait_idle_at_the_activator(cluster, namespace)
