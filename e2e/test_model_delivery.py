"""Model delivery end to end (issue 26 item 9): ``spec.model.source`` is an http:// URL on a local file
server (``harness.file_server``, standing in for a mirror; nothing is fetched from the internet), the
pod's init container (``kvpilot operator fetch-model``, run by the process kubelet) fetches it into the
model cache and checks its sha256, and the real engine and router start from the fetched GGUF. A wrong
checksum and a file over ``sizeLimit`` fail with a condition naming what went wrong, and no engine runs.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from harness.cluster import HarnessCluster
from harness.file_server import FileServer
from harness.process_runner import ProcessPodRunner

from kvpilot.engine.model.registry import bundled_smollm2_gguf

pytestmark = pytest.mark.e2e

ISVC = "kvpilot.dev/v1alpha1/inferenceservices"
# Fetch (98 MB over loopback), GGUF conversion and load on a 2-core machine, then a startup-probe period:
# a bound with room for a busy machine, not the expected time.
READY_TIMEOUT_S = 300
# The engine's C kernels would be compiled afresh in every pod's empty cache (minutes on 2 cores);
# PyTorch's ops serve the same tokens.
ENGINE = "{kvCacheMemory: 64Mi, extraArgs: ['--warmup-buckets', '1x8', '--native-cpu-ops', 'off']}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HarnessCluster]:
    """A harness cluster whose kubelet runs real processes (replaces conftest's fake-pod cluster here)."""
    workdir = tmp_path_factory.mktemp("delivery")
    runner = ProcessPodRunner(workdir / "pods", kubeconfig=workdir / "kubeconfig")
    harness = HarnessCluster(workdir, runner=runner)
    try:
        yield harness.start()
    finally:
        try:
            harness.stop()
        finally:
            runner.kill_all()
            sys.stderr.write(f"\n--- container logs ---\n{runner.log_tails()}\n")


@pytest.fixture(scope="module")
def mirror() -> Iterator[FileServer]:
    server = FileServer().start()
    yield server
    server.stop()


def manifest(namespace: str, name: str, model: str) -> str:
    return (
        f"apiVersion: kvpilot.dev/v1alpha1\nkind: InferenceService\n"
        f"metadata: {{name: {name}, namespace: {namespace}}}\n"
        f"spec:\n  model: {model}\n  engine: {ENGINE}\n  resources: {{memory: 3Gi}}\n"
        f"  scaling: {{replicas: 1, spare: 0}}\n"
    )


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def status_of(cluster: HarnessCluster, namespace: str, name: str) -> dict:
    return (cluster.get(ISVC, namespace, name) or {}).get("status", {})


def failed_condition(cluster: HarnessCluster, namespace: str, name: str) -> dict:
    """The Ready condition once the service is Failed because of its model fetch."""

    def failed() -> dict | None:
        status = status_of(cluster, namespace, name)
        ready = next((c for c in status.get("conditions", []) if c["type"] == "Ready"), {})
        return (
            ready if status.get("phase") == "Failed" and ready.get("reason") == "ModelFetchFailed" else None
        )

    return cluster.wait_for(f"{name} Failed with reason ModelFetchFailed", failed, timeout=60)


def no_engine_ran(cluster: HarnessCluster, namespace: str) -> bool:
    runner: ProcessPodRunner = cluster.runner
    return all(not c.pids for c in runner.containers(namespace) if c.name in ("engine", "router"))


def test_a_model_served_over_http_is_fetched_verified_and_served(cluster, kubectl, namespace, mirror):
    gguf = bundled_smollm2_gguf()
    url = mirror.serve("/models/smollm2-135m.Q4_1.gguf", gguf)
    model = f"{{source: '{url}', sha256: {sha256(gguf)}, sizeLimit: 200Mi, servedName: smol}}"
    kubectl("apply", "-f", "-", stdin=manifest(namespace, "smol", model))
    status = cluster.wait_for(
        "smol Ready",
        lambda: (s := status_of(cluster, namespace, "smol")).get("phase") == "Ready" and s,
        timeout=READY_TIMEOUT_S,
    )
    assert status["readyReplicas"] == 1
    (pod,) = cluster.list("v1/pods", namespace)
    (fetched,) = pod["status"]["initContainerStatuses"]
    assert fetched["name"] == "fetch-model" and fetched["state"]["terminated"]["exitCode"] == 0
    engine = pod["spec"]["containers"][0]
    assert engine["args"][:2] == ["--model", "/model-cache/smollm2-135m.Q4_1.gguf"]
    # the file in the pod's cache volume is the served one, fetched once
    cached = cluster.workdir / "pods" / namespace / pod["metadata"]["name"] / "volumes" / "model-cache"
    assert [p.name for p in cached.iterdir()] == ["smollm2-135m.Q4_1.gguf"]
    assert sha256(cached / "smollm2-135m.Q4_1.gguf") == sha256(gguf)
    assert mirror.requests.count("/models/smollm2-135m.Q4_1.gguf") == 1

    router = f"http://{pod['status']['podIP']}:8080"
    client = openai.OpenAI(base_url=f"{router}/v1", api_key="unused", max_retries=0, timeout=60)
    completion = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=4)
    assert completion.model == "smol" and completion.usage.completion_tokens > 0


def test_a_wrong_checksum_fails_with_a_condition_naming_the_mismatch(
    cluster, kubectl, namespace, mirror, tmp_path
):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(os.urandom(4096))
    url = mirror.serve("/bad/model.gguf", fake)
    wrong = "0" * 64
    kubectl("apply", "-f", "-", stdin=manifest(namespace, "bad", f"{{source: '{url}', sha256: '{wrong}'}}"))
    ready = failed_condition(cluster, namespace, "bad")
    assert ready["status"] == "False"
    assert (
        f"model fetch failed: sha256 mismatch for {url}: expected {wrong}, got {sha256(fake)}"
        in ready["message"]
    )
    assert no_engine_ran(cluster, namespace)


def test_a_file_over_the_size_limit_is_refused(cluster, kubectl, namespace, mirror, tmp_path):
    big = tmp_path / "big.gguf"
    big.write_bytes(bytes(3 << 20))
    url = mirror.serve("/big/model.gguf", big)
    kubectl("apply", "-f", "-", stdin=manifest(namespace, "big", f"{{source: '{url}', sizeLimit: 1Mi}}"))
    ready = failed_condition(cluster, namespace, "big")
    assert (
        f"model fetch failed: {url} is 3.0 MiB, over the size limit (1.0 MiB, model.sizeLimit): "
        "refused before downloading"
    ) in ready["message"]
    assert no_engine_ran(cluster, namespace)
    pod = cluster.list("v1/pods", namespace)[0]["metadata"]["name"]
    assert not list((cluster.workdir / "pods" / namespace / pod / "volumes" / "model-cache").iterdir())
