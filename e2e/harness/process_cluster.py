"""A harness cluster whose kubelet runs real processes (``ProcessPodRunner``): the engine, router and
activator pods are ``kvpilot`` processes. Tests that need real engines take it instead of conftest's
fake-pod cluster; on the way out it stops the cluster, kills whatever the orderly stop missed (a stuck
loop, a failed start) and writes the containers' log tails to stderr for the test report."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from harness.cluster import HarnessCluster
from harness.process_runner import ProcessPodRunner


@contextmanager
def process_cluster(workdir: Path) -> Iterator[HarnessCluster]:
    runner = ProcessPodRunner(workdir / "pods", kubeconfig=workdir / "kubeconfig")
    harness = HarnessCluster(workdir, runner=runner)
    assert harness.kubeconfig == runner.kubeconfig
    try:
        yield harness.start()
    finally:
        try:
            harness.stop()
        finally:
            runner.kill_all()
            sys.stderr.write(f"\n--- container logs ---\n{runner.log_tails()}\n")
