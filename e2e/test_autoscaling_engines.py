"""End to end with real engines: the operator's autoscaler under a load ramp on ``kvpilot serve`` +
``kvpilot router`` processes (the process kubelet), docs/architecture.md#autoscaling.

The spec's ``perReplicaGoodput`` is deliberately far too high (1000 requests/s): on it alone the count
would never move. Three closed-loop clients saturate the one engine (2 sequence slots, so requests queue);
the autoscaler measures its goodput from the SLO counters, the measured value replaces the spec's, and
the count goes to 2. With the load down to one slow client it goes back to 1 after the down window. Every
request is answered 200, during the scale-up and the scale-down. Slow: each replica's cold start is one or
two startup-probe periods (10 s).
"""

from __future__ import annotations

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
ROUTER_PORT = 8080
TIMEOUT_S = 240  # a bound for a shared 2-core machine, not the expected time


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HarnessCluster]:
    with process_cluster(tmp_path_factory.mktemp("autoscaling")) as harness:
        yield harness


MANIFEST = """\
apiVersion: kvpilot.dev/v1alpha1
kind: InferenceService
metadata: {{name: tiny, namespace: {namespace}}}
spec:
  model: {{source: tiny-random, servedName: tiny}}
  engine: {{kvCacheMemory: 1Mi, maxNumSeqs: 2, maxNumBatchedTokens: 64,
    extraArgs: ['--warmup-buckets', '1x8']}}
  slo: {{ttftSeconds: 30, tpotSeconds: 10}}
  scaling: {{perReplicaGoodput: 1000, headroom: 0.2, spare: 0, minReplicas: 1, maxReplicas: 2}}
  autoscaling: {{mode: operator, intervalSeconds: 2, rateWindowSeconds: 6, scaleDownStabilizationSeconds: 20,
    cooldownSeconds: 10, minGoodputSamples: 2}}
"""


def status_of(cluster: HarnessCluster, namespace: str) -> dict:
    return (cluster.get(ISVC, namespace, NAME) or {}).get("status", {})


def wait_ready(cluster: HarnessCluster, namespace: str, replicas: int) -> dict:
    return cluster.wait_for(
        f"Ready {replicas}/{replicas}",
        lambda: (
            (s := status_of(cluster, namespace)).get("phase") == "Ready"
            and s.get("readyReplicas") == replicas == s.get("desiredReplicas")
            and s
        ),
        timeout=TIMEOUT_S,
    )


class Clients:
    """Closed-loop clients; each request goes to a ready endpoint of the client Service, picked afresh
    (kube-proxy's part), and every answer is counted."""

    def __init__(self, cluster: HarnessCluster, namespace: str) -> None:
        self.cluster, self.namespace = cluster, namespace
        self.ok, self.failed, self.waits = 0, [], 0
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._threads: list[threading.Thread] = []

    def _router(self, turn: int) -> str:
        """A ready endpoint; while there is none (a saturated engine can miss its readiness probe on a
        loaded machine), wait for one as a client retrying its connection would, and count the wait."""
        while True:
            slice_ = self.cluster.get("discovery.k8s.io/v1/endpointslices", self.namespace, f"{NAME}-harness")
            endpoints = (slice_ or {}).get("endpoints", [])
            ready = [e["addresses"][0] for e in endpoints if e["conditions"]["ready"]]
            if ready:
                return f"http://{ready[turn % len(ready)]}:{ROUTER_PORT}"
            with self._lock:
                self.waits += 1
            time.sleep(0.2)

    def _loop(self, stop: threading.Event, pause: float) -> None:
        turn = 0
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                turn += 1
                body = {"model": NAME, "prompt": f"request {turn} of the ramp", "max_tokens": 8}
                try:
                    response = client.post(f"{self._router(turn)}/v1/completions", json=body)
                    outcome = response.status_code
                except httpx.HTTPError as error:
                    outcome = repr(error)
                with self._lock:
                    if outcome == 200:
                        self.ok += 1
                    else:
                        self.failed.append(outcome)
                stop.wait(pause)

    def run(self, count: int, pause: float = 0.0) -> threading.Event:
        stop = threading.Event()
        for _ in range(count):
            thread = threading.Thread(target=self._loop, args=(stop, pause), daemon=True)
            thread.start()
            self._threads.append(thread)
        return stop

    def join(self) -> None:
        for thread in self._threads:
            thread.join(90)


def test_load_ramp_scales_on_measured_goodput_and_loses_no_request(cluster, kubectl, namespace):
    kubectl("apply", "-f", "-", stdin=MANIFEST.format(namespace=namespace))
    quiet = wait_ready(cluster, namespace, 1)
    assert quiet["sizing"]["goodputSource"] == "Spec"

    clients = Clients(cluster, namespace)
    step = time.monotonic()
    heavy = clients.run(3)
    scaled = cluster.wait_for(
        "desired 2",
        lambda: (s := status_of(cluster, namespace)).get("desiredReplicas") == 2 and s,
        timeout=TIMEOUT_S,
    )
    decided = time.monotonic() - step
    # The decision that scaled: the measured goodput replaced the spec's 1000 requests/s; with it, N = 2.
    sizing = scaled["sizing"]
    assert sizing["goodputSource"] == "Measured" and sizing["goodputSamples"] >= 2, sizing
    assert 0 < sizing["goodput"] < 1000 and sizing["serving"] == 2, sizing
    assert sizing["decision"] == "ScaleUp", sizing
    wait_ready(cluster, namespace, 2)
    ready = time.monotonic() - step
    sys.stderr.write(
        f"\nreal engines: load step -> desired 2: {decided:.1f} s, -> 2 Ready: {ready:.1f} s; "
        f"measured goodput {sizing['goodput']} req/s at arrival {sizing['arrivalRate']} req/s\n"
    )

    heavy.set()
    light = clients.run(1, pause=1.0)  # one slow client: well under one replica's goodput
    wait_ready(cluster, namespace, 1)
    time.sleep(3)  # the slow client keeps sending to the one replica left
    light.set()
    clients.join()
    assert clients.failed == [] and clients.ok > 0, (clients.ok, clients.failed[:5])
    sys.stderr.write(
        f"real engines: {clients.ok} requests answered, none lost; "
        f"{clients.waits} waits for a ready endpoint\n"
    )
