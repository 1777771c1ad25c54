"""The chart's pre-delete hook (charts/kvpilot/files/uninstall_hook.py) against the harness and a real
operator: run with the arguments the chart renders for its Job, as `helm uninstall` would run it.

- delete: every InferenceService is deleted while the operator runs and the operator finalizes it (children
  collected); with the operator already gone, the hook removes the finalizer itself after its timeout;
- orphan: the operator's Deployment is scaled to zero (the test stops the operator process when it is, as
  the kubelet would), the finalizer is removed, the models keep running, a later delete is immediate and a
  restarted operator adopts them again;
- the hook changes nothing unless Helm's release record says the release is being uninstalled.

Each test runs its own operator process (the module-wide one of conftest.py cannot be stopped by one test).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness.cluster import HarnessCluster

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "kvpilot"
HOOK = CHART / "files" / "uninstall_hook.py"
ISVC = "kvpilot.dev/v1alpha1/inferenceservices"
DEPLOYMENTS = "apps/v1/deployments"
FINALIZER = "kvpilot.dev/finalizer"
RELEASE = "kvpilot"
KVPILOT = str(Path(sys.executable).parent / "kvpilot")
_numbers = iter(range(1, 1000))
# as conftest.py runs it: status refreshed every 0.3 s
OPERATOR_FLAGS = ("--status-interval", "0.3", "--engine-probe-timeout", "0.3", "--log-format", "plain")
Kubectl = Any  # conftest.Kubectl: kubectl with the harness's kubeconfig in .env


def start_operator(cluster: HarnessCluster, kubectl: Kubectl, log_path: Path) -> subprocess.Popen[str]:
    with log_path.open("a") as log:
        return subprocess.Popen(
            [KVPILOT, "operator", "run", "--all-namespaces", "--standalone", *OPERATOR_FLAGS],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            env=kubectl.env,
        )


def stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


@pytest.fixture()
def operator(cluster: HarnessCluster, kubectl: Kubectl) -> Iterator[subprocess.Popen[str]]:
    """This module's operator: one per test (overrides conftest's module-wide one)."""
    log_path = cluster.workdir / f"operator-{next(_numbers)}.log"
    process = start_operator(cluster, kubectl, log_path)
    yield process
    stop(process)
    sys.stderr.write(f"\n--- operator log ({log_path}) ---\n{log_path.read_text()[-4000:]}\n")


def inference_service(namespace: str, name: str) -> str:
    return (
        "apiVersion: kvpilot.dev/v1alpha1\nkind: InferenceService\n"
        f"metadata: {{name: {name}, namespace: {namespace}}}\n"
        "spec:\n  model: {source: smollm2-135m}\n  scaling: {replicas: 1, spare: 0}\n"
    )


def apply_services(cluster: HarnessCluster, kubectl: Kubectl, namespace: str, names: list[str]) -> None:
    for name in names:
        kubectl("apply", "-f", "-", stdin=inference_service(namespace, name))
    for name in names:
        cluster.wait_for(
            f"{name} finalized by the operator and its Deployment",
            lambda name=name: (
                FINALIZER
                in (cluster.get(ISVC, namespace, name) or {}).get("metadata", {}).get("finalizers", [])
                and cluster.get(DEPLOYMENTS, namespace, name)
            ),
        )


def helm_release_record(kubectl: Kubectl, namespace: str, status: str) -> None:
    """What Helm keeps of a release (driver Secret), marked as `helm uninstall` marks it before its hooks."""
    record = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "helm.sh/release.v1",
        "metadata": {
            "name": f"sh.helm.release.v1.{RELEASE}.v1",
            "namespace": namespace,
            "labels": {"owner": "helm", "name": RELEASE, "status": status, "version": "1"},
        },
        "data": {},
    }
    kubectl("apply", "-f", "-", stdin=yaml.safe_dump(record))


def rendered(namespace: str, *values: str) -> list[dict]:
    sets = [arg for value in values for arg in ("--set", value)]
    helm = REPO / ".tools" / "bin" / "helm"
    if not helm.exists():
        pytest.fail("helm is missing: run `bash scripts/setup.sh`", pytrace=False)
    out = subprocess.run(
        [str(helm), "template", RELEASE, str(CHART), "--namespace", namespace, *sets],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def hook_args(namespace: str, *values: str, only_this_namespace: bool = True) -> list[str]:
    """The Job's arguments as the chart renders them for a release in ``namespace``; by default watching
    only that namespace, so that what other tests left elsewhere is out of the hook's reach."""
    if only_this_namespace:
        values = (f"watchNamespaces={{{namespace}}}", *values)
    job = next(d for d in rendered(namespace, *values) if d["kind"] == "Job")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python", "/hook/uninstall_hook.py"]
    return container["args"]


def run_hook(kubectl: Kubectl, args: list[str], timeout: float = 90) -> subprocess.CompletedProcess[str]:
    # The script's own folder, not the repo root, is sys.path[0]: no `operator/` shadowing.
    return subprocess.run(
        [sys.executable, str(HOOK), *args],
        capture_output=True,
        text=True,
        env=kubectl.env,
        timeout=timeout,
        cwd="/",
    )


def test_delete_mode_lets_the_running_operator_finalize_every_service(cluster, kubectl, namespace):
    apply_services(cluster, kubectl, namespace, ["alpha", "beta"])
    helm_release_record(kubectl, namespace, "uninstalling")
    started = time.monotonic()
    result = run_hook(kubectl, hook_args(namespace))
    assert result.returncode == 0, result.stdout + result.stderr
    assert time.monotonic() - started < 30
    assert "every InferenceService is gone" in result.stdout
    assert "removing its finalizer" not in result.stdout  # the operator did it
    assert cluster.list(ISVC, namespace) == []
    cluster.wait_for("children collected", lambda: not cluster.list(DEPLOYMENTS, namespace))


def test_delete_mode_removes_the_finalizer_when_the_operator_is_gone(cluster, kubectl, namespace, operator):
    apply_services(cluster, kubectl, namespace, ["alpha"])
    helm_release_record(kubectl, namespace, "uninstalling")
    stop(operator)
    # all namespaces, as a default install watches them
    args = hook_args(namespace, only_this_namespace=False)
    assert not any(arg.startswith("--namespace=") for arg in args)
    result = run_hook(kubectl, [*args, "--timeout=2"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "removing its finalizer" in result.stdout
    assert f"removed {FINALIZER} from {namespace}/alpha" in result.stdout
    assert cluster.list(ISVC, namespace) == []
    cluster.wait_for("children collected", lambda: not cluster.list(DEPLOYMENTS, namespace))


@pytest.mark.parametrize("status", ["deployed", None])
def test_the_hook_changes_nothing_outside_an_uninstall(cluster, kubectl, namespace, status):
    apply_services(cluster, kubectl, namespace, ["alpha"])
    if status:
        helm_release_record(kubectl, namespace, status)
    for mode in ("delete", "orphan"):
        result = run_hook(kubectl, hook_args(namespace, f"uninstall.inferenceServices={mode}"))
        assert result.returncode == 2, result.stdout + result.stderr
        assert "refusing" in result.stdout
    alpha = cluster.get(ISVC, namespace, "alpha")
    assert "deletionTimestamp" not in alpha["metadata"]
    assert FINALIZER in alpha["metadata"]["finalizers"]


def test_orphan_mode_stops_the_operator_and_leaves_the_models_serving(cluster, kubectl, namespace, operator):
    apply_services(cluster, kubectl, namespace, ["alpha", "beta"])
    helm_release_record(kubectl, namespace, "uninstalling")
    # The chart's operator Deployment, and a pod with its labels standing for the operator process: the
    # pod goes only once the process has stopped, as a real operator pod's does.
    chart = rendered(namespace, "uninstall.inferenceServices=orphan")
    deployment = next(d for d in chart if d["kind"] == "Deployment")
    kubectl("apply", "-f", "-", stdin=yaml.safe_dump(deployment))
    name = deployment["metadata"]["name"]
    labels = deployment["spec"]["selector"]["matchLabels"]
    process_pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "operator-process", "namespace": namespace, "labels": labels},
        "spec": {"containers": [{"name": "operator", "image": "kvpilot"}]},
    }
    kubectl("apply", "-f", "-", stdin=yaml.safe_dump(process_pod))

    def kubelet_stops_the_operator() -> None:  # what scaling to zero does to the real operator's pod
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if (cluster.get(DEPLOYMENTS, namespace, name) or {}).get("spec", {}).get("replicas") == 0:
                stop(operator)
                kubectl("delete", "pod", "operator-process", "-n", namespace, "--wait=false")
                return
            time.sleep(0.1)

    watcher = threading.Thread(target=kubelet_stops_the_operator, daemon=True)
    watcher.start()
    result = run_hook(kubectl, hook_args(namespace, "uninstall.inferenceServices=orphan"))
    watcher.join(5)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"scaled the operator Deployment {namespace}/{name} to 0" in result.stdout
    assert operator.poll() is not None
    for service in ("alpha", "beta"):
        obj = cluster.get(ISVC, namespace, service)
        assert FINALIZER not in obj["metadata"].get("finalizers", []), obj["metadata"]
        assert "deletionTimestamp" not in obj["metadata"]
        assert cluster.get(DEPLOYMENTS, namespace, service)  # still serving, unmanaged

    # without an operator, deleting an orphaned service no longer hangs
    kubectl("delete", "inferenceservice", "beta", "-n", namespace, "--timeout=20s")
    cluster.wait_for("beta's children collected", lambda: not cluster.get(DEPLOYMENTS, namespace, "beta"))

    # an operator installed again adopts what is left
    log_path = cluster.workdir / f"operator-readopt-{next(_numbers)}.log"
    again = start_operator(cluster, kubectl, log_path)
    try:
        cluster.wait_for(
            "alpha adopted",
            lambda: FINALIZER in cluster.get(ISVC, namespace, "alpha")["metadata"].get("finalizers", []),
        )
    finally:
        stop(again)
