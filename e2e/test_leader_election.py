"""Leader election (issue 26 item 8): several ``kvpilot operator run --leader-elect`` processes against the
harness, and only the one holding the Lease reconciles.

Each process gets its own kubeconfig whose bearer token names it, so every request the API server records
says which replica sent it. Lease timing is shortened (3 s lease, 2 s renew deadline, 0.25 s retry) so
that a takeover after a hard kill takes seconds; the bounds asserted are the algorithm's, with slack for a
busy 2-core machine.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml
from harness.cluster import HarnessCluster

pytestmark = pytest.mark.e2e

KVPILOT = str(Path(sys.executable).parent / "kvpilot")
ISVC = "kvpilot.dev/v1alpha1/inferenceservices"
DEPLOYMENTS = "apps/v1/deployments"
LEASES = "coordination.k8s.io/v1/leases"
LEASE_S, RENEW_DEADLINE_S, RETRY_S = 3.0, 2.0, 0.25
SLACK_S = 4.0  # process start-up and a loaded machine, on top of the algorithm's own bound
CHILD_KINDS = 8  # ServiceAccount, Role, RoleBinding, Secret, 2 Services, PodDisruptionBudget, Deployment


class Replica:
    """One operator process, named by ``identity`` in the Lease and in its requests' bearer token."""

    def __init__(self, cluster: HarnessCluster, identity: str, lease: str) -> None:
        self.identity, self.token = identity, f"token-{identity}"
        config = yaml.safe_load(cluster.kubeconfig.read_text())
        config["users"][0]["user"]["token"] = self.token
        kubeconfig = cluster.workdir / f"kubeconfig-{identity}"
        kubeconfig.write_text(yaml.safe_dump(config))
        self.log_path = cluster.workdir / f"operator-{identity}.log"
        flags = [
            "--all-namespaces",
            "--leader-elect",
            f"--lease-name={lease}",
            "--lease-namespace=default",
            f"--identity={identity}",
            f"--lease-duration={LEASE_S}",
            f"--lease-renew-deadline={RENEW_DEADLINE_S}",
            f"--lease-retry-period={RETRY_S}",
            "--status-interval=0.3",
            "--engine-probe-timeout=0.3",
            "--log-format=plain",
        ]
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                [KVPILOT, "operator", "run", *flags],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={"KUBECONFIG": str(kubeconfig), "PATH": str(Path(sys.executable).parent)},
            )

    def requests(self, cluster: HarnessCluster, since: int = 0) -> list[Any]:
        return [
            r for r in list(cluster.api)[since:] if r.headers.get("Authorization") == f"Bearer {self.token}"
        ]

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


@pytest.fixture()
def replicas(cluster: HarnessCluster, kubectl: Any) -> Iterator[list[Replica]]:
    started: list[Replica] = []
    yield started
    for replica in started:
        replica.stop(signal.SIGKILL)
        sys.stderr.write(f"\n--- {replica.log_path.name} ---\n{replica.log_path.read_text()[-3000:]}\n")


def holder(cluster: HarnessCluster, lease: str) -> str | None:
    return ((cluster.get(LEASES, "default", lease) or {}).get("spec") or {}).get("holderIdentity")


def wait_holder(cluster: HarnessCluster, lease: str, identity: str, timeout: float) -> float:
    """Seconds until ``identity`` holds the Lease."""
    started = time.monotonic()
    cluster.wait_for(f"{identity} holding lease {lease}", lambda: holder(cluster, lease) == identity, timeout)
    return time.monotonic() - started


def manifest(namespace: str) -> str:
    return (
        "apiVersion: kvpilot.dev/v1alpha1\nkind: InferenceService\n"
        f"metadata: {{name: smol, namespace: {namespace}}}\n"
        "spec:\n  model: {source: smollm2-135m}\n  scaling: {replicas: 1}\n"
    )


def test_only_the_leader_reconciles_and_an_orderly_exit_hands_over_at_once(cluster, kubectl, replicas):
    lease = "graceful"
    first = Replica(cluster, "first", lease)
    replicas.append(first)
    wait_holder(cluster, lease, "first", timeout=30)
    second = Replica(cluster, "second", lease)
    replicas.append(second)
    cluster.wait_for("the second replica campaigning", lambda: len(second.requests(cluster)) >= 3, timeout=30)

    cluster.create_namespace("leader-1")
    kubectl("apply", "-f", "-", stdin=manifest("leader-1"))
    cluster.wait_for(
        "smol Ready",
        lambda: (cluster.get(ISVC, "leader-1", "smol") or {}).get("status", {}).get("phase") == "Ready",
    )
    # The standby only ever read and tried the Lease; the leader created each child once.
    assert {r.url.path for r in second.requests(cluster)} == {
        f"/apis/coordination.k8s.io/v1/namespaces/default/leases/{lease}"
    }
    creates = [r for r in first.requests(cluster) if r.method.value == "POST" and "/leader-1/" in r.url.path]
    assert len(creates) == CHILD_KINDS
    assert holder(cluster, lease) == "first"

    # SIGTERM: Kopf stops, the Lease is released, and the standby takes it at its next round.
    first.stop(signal.SIGTERM)
    assert first.process.returncode == 0
    assert wait_holder(cluster, lease, "second", timeout=10) < RETRY_S + SLACK_S
    mark = len(list(cluster.api))
    kubectl("delete", "deployment", "smol", "-n", "leader-1")
    cluster.wait_for(
        "the Deployment restored", lambda: cluster.get(DEPLOYMENTS, "leader-1", "smol"), timeout=20
    )
    assert any(
        r.method.value == "POST" and r.url.path.endswith("/deployments")
        for r in second.requests(cluster, mark)
    )
    assert not first.requests(cluster, mark)


def test_a_killed_leader_is_replaced_once_its_lease_expires(cluster, kubectl, replicas):
    lease = "hard-kill"
    leader = Replica(cluster, "leader", lease)
    replicas.append(leader)
    wait_holder(cluster, lease, "leader", timeout=30)
    standby = Replica(cluster, "standby", lease)
    replicas.append(standby)
    cluster.wait_for("the standby campaigning", lambda: len(standby.requests(cluster)) >= 3, timeout=30)

    leader.stop(signal.SIGKILL)  # no release: the standby must wait the lease out
    took_over = wait_holder(cluster, lease, "standby", timeout=LEASE_S + RETRY_S + SLACK_S)
    # Not before the lease expired (the last renewal was at most one retry period before the kill) ...
    assert took_over >= LEASE_S - RETRY_S - 0.5
    lease_object = cluster.get(LEASES, "default", lease)
    assert lease_object["spec"]["leaseTransitions"] == 1

    # ... and it reconciles from then on.
    cluster.create_namespace("leader-2")
    kubectl("apply", "-f", "-", stdin=manifest("leader-2"))
    cluster.wait_for(
        "smol Ready under the new leader",
        lambda: (cluster.get(ISVC, "leader-2", "smol") or {}).get("status", {}).get("phase") == "Ready",
    )
    creates = [
        r for r in standby.requests(cluster) if r.method.value == "POST" and "/leader-2/" in r.url.path
    ]
    assert len(creates) == CHILD_KINDS


def test_a_leader_that_cannot_renew_stops_reconciling(cluster, kubectl, replicas):
    """The Lease taken over underneath a leader (as when its renewals fail for longer than the deadline and
    another replica takes it): the leader exits at once instead of reconciling beside the new one."""
    lease = "stolen"
    leader = Replica(cluster, "victim", lease)
    replicas.append(leader)
    wait_holder(cluster, lease, "victim", timeout=30)
    stolen = cluster.get(LEASES, "default", lease)
    stolen["spec"]["holderIdentity"] = "someone-else"
    # written as the server's own update (no resourceVersion check to race with the leader's renewals)
    cluster.call(cluster.api.update((kmock.resource(LEASES), "default", lease), stolen))
    cluster.wait_for(
        "the old leader exiting", lambda: leader.process.poll() is not None, timeout=RETRY_S + SLACK_S
    )
    assert leader.process.returncode == 3  # EXIT_LOST_LEADERSHIP: the Deployment restarts it as a candidate
