"""End to end: the autoscaler reading its signals from a real Prometheus server (Debian's ``prometheus``
binary) that scrapes the harness pods' ``/metrics`` (docs/architecture.md#autoscaling).

Prometheus finds the pods through a file_sd target file this test keeps in step with the pods (the part a
PodMonitor plays on a cluster), labelled ``namespace``, ``pod`` and ``inferenceservice`` as the chart's
PodMonitor labels them; it scrapes every second. Skipped where no ``prometheus`` binary is installed.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from harness.cluster import HarnessCluster
from test_autoscaling import Load, manifest, wait_ready

pytestmark = pytest.mark.e2e
PROMETHEUS = shutil.which("prometheus")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture()
def prometheus(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    if PROMETHEUS is None:
        pytest.skip("no prometheus binary (Debian: apt-get install prometheus)")
    targets = tmp_path / "targets.json"
    targets.write_text("[]")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: engines\n"
        f"    file_sd_configs: [{{files: ['{targets}'], refresh_interval: 1s}}]\n"
    )
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "prometheus.log").open("w"),
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "prometheus did not become ready in 30 s"
            time.sleep(0.2)
        yield url, targets
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def _publish_targets(cluster: HarnessCluster, namespace: str, targets: Path, stop: threading.Event) -> None:
    """What a PodMonitor does: every pod of the InferenceService a target, with its labels."""
    while not stop.is_set():
        entries = [
            {
                "targets": [f"{pod['status']['podIP']}:8000"],
                "labels": {
                    "namespace": namespace,
                    "pod": pod["metadata"]["name"],
                    "inferenceservice": pod["metadata"]["labels"]["kvpilot.dev/inferenceservice"],
                },
            }
            for pod in cluster.list("v1/pods", namespace)
            if pod.get("status", {}).get("podIP")
        ]
        partial = targets.with_suffix(".tmp")
        partial.write_text(json.dumps(entries))
        partial.replace(targets)  # whole files only: Prometheus may read at any time
        stop.wait(0.3)


def test_autoscaler_reads_a_load_step_from_prometheus(cluster, kubectl, namespace, prometheus):
    url, targets = prometheus
    load = Load()
    cluster.runner.metrics = load.metrics
    stop = threading.Event()
    publisher = threading.Thread(
        target=_publish_targets, args=(cluster, namespace, targets, stop), daemon=True
    )
    publisher.start()
    spec = (
        "  scaling: {perReplicaGoodput: 2, headroom: 0, spare: 1, minReplicas: 1, maxReplicas: 5}\n"
        f"  autoscaling: {{mode: operator, prometheusUrl: '{url}', intervalSeconds: 1,\n"
        "    rateWindowSeconds: 4, scaleDownStabilizationSeconds: 3, cooldownSeconds: 0}\n"
    )
    try:
        kubectl("apply", "-f", "-", stdin=manifest(namespace, "smol", spec))
        quiet = wait_ready(cluster, namespace, "smol", 1, timeout=60)
        assert quiet["sizing"]["signalSource"] == "Prometheus"
        (alive,) = cluster.list("v1/pods", namespace)
        load.pod = alive["metadata"]["name"]
        step = load.set(6.0)  # 6 req/s at 2 per replica: N 3 + spare 1
        busy = wait_ready(cluster, namespace, "smol", 4, timeout=45)
        assert busy["sizing"]["signalSource"] == "Prometheus"
        assert (busy["sizing"]["serving"], busy["sizing"]["measuredEngines"] >= 1) == (3, True)
        assert 4 < busy["sizing"]["arrivalRate"] <= 6.6, busy["sizing"]  # rate() extrapolates a little
        print(f"\nprometheus: load step -> 4 Ready: {time.monotonic() - step:.1f} s")
        load.set(0.0)
        wait_ready(cluster, namespace, "smol", 1, timeout=45)
    finally:
        stop.set()
        publisher.join(5)
        cluster.runner.metrics = None
