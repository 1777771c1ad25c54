"""``ProcessPodRunner``: the harness kubelet runs each pod's containers as real local processes.

Every pod has its own loopback address (the harness hands out ``127.x.y.N``; the whole 127.0.0.0/8 is
local on Linux, no setup needed). Addresses rather than distinct ports, because then nothing about the
pod has to be rewritten but the listen address: the template's container ports, the probes' ports, the
Services' target ports and the EndpointSlices (one port for all endpoints, as the API requires) all stay
as a cluster has them, and the router reaches every engine at ``<pod IP>:8000`` exactly as in a cluster.

Each container runs under a ``ContainerSupervisor`` (restarts with back-off, startup/readiness/liveness
probes, container status); this module adds the pod: its directory (``<pods_dir>/<namespace>/<pod>``,
holding its emptyDir volumes and one log per container), the pod phase and conditions, and deletion:
SIGTERM to every container, SIGKILL after ``terminationGracePeriodSeconds``. What is *not* emulated:
the image (the local ``kvpilot`` runs), resource requests and limits, security contexts, volumes other
than emptyDir, network isolation (a process can reach any pod's address, and ``localhost`` is not the
pod's own), lifecycle hooks (refused), and graceful deletion in the API (the harness removes a deleted pod
at once; its processes stop afterwards). Init containers run one after the other before the pod's
containers start, each until it exits 0 (restarted with back-off after a failure).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from harness.container_launch import build_launch, empty_dirs
from harness.container_process import timestamp
from harness.container_supervisor import ContainerSupervisor
from harness.probes import PROBE_FIELDS, UnsupportedPod, parse_probe

DEFAULT_GRACE_S = 30  # terminationGracePeriodSeconds when the pod does not say


@dataclass
class RunningPod:
    namespace: str
    name: str
    supervisors: list[ContainerSupervisor]
    start_time: str
    grace_s: float
    init: list[ContainerSupervisor] = field(default_factory=list)

    @property
    def initialized(self) -> bool:
        return all(s.completed for s in self.init)

    @property
    def everything(self) -> list[ContainerSupervisor]:
        return [*self.init, *self.supervisors]


def _unsupported_pod_fields(pod: dict[str, Any]) -> str | None:
    spec = pod["spec"]
    for container in [*spec.get("initContainers", []), *spec["containers"]]:
        if container.get("lifecycle"):
            return f"container {container['name']!r}: lifecycle hooks are not emulated"
    return None


def _condition(kind: str, true: bool, previous: dict[str, Any], reason: str = "") -> dict[str, Any]:
    status = "True" if true else "False"
    before = next((c for c in previous.get("conditions", []) if c.get("type") == kind), {})
    since = before.get("lastTransitionTime") if before.get("status") == status else None
    condition = {"type": kind, "status": status, "lastTransitionTime": since or timestamp()}
    if reason and not true:
        condition["reason"] = reason
    return condition


def pod_status(running: RunningPod, pod_ip: str, previous: dict[str, Any]) -> dict[str, Any]:
    """The pod status a kubelet reports: phase, conditions and one status per container."""
    initialized = running.initialized
    containers = [s.status() for s in running.supervisors]
    if not initialized:
        for status in containers:
            status["state"] = {"waiting": {"reason": "PodInitializing"}}
    ready = initialized and all(s.ready for s in running.supervisors)
    # Pending until every container has been created once; restarts and back-off do not make it Pending.
    phase = "Running" if initialized and all(s.ever_ran for s in running.supervisors) else "Pending"
    status = {
        "phase": phase,
        "podIP": pod_ip,
        "podIPs": [{"ip": pod_ip}],
        "hostIP": "127.0.0.1",
        "startTime": running.start_time,
        "conditions": [
            _condition("PodScheduled", True, previous),
            _condition("Initialized", initialized, previous, "ContainersNotInitialized"),
            _condition("ContainersReady", ready, previous, "ContainersNotReady"),
            _condition("Ready", ready, previous, "ContainersNotReady"),
        ],
        "containerStatuses": containers,
    }
    if running.init:
        status["initContainerStatuses"] = [s.status() for s in running.init]
    return status


class ProcessPodRunner:
    def __init__(self, pods_dir: Path, kubeconfig: Path, shutdown_grace_s: float = 5.0) -> None:
        """``kubeconfig`` is what every container gets as ``KUBECONFIG`` (the harness cluster's);
        ``shutdown_grace_s`` caps the grace period when the whole harness stops (``close``)."""
        self.pods_dir, self.kubeconfig, self.shutdown_grace_s = pods_dir, kubeconfig, shutdown_grace_s
        self._pods: dict[str, RunningPod] = {}  # by pod uid
        self._stopping: set[asyncio.Task[Any]] = set()
        self._supervisors: list[ContainerSupervisor] = []  # every one ever made, for kill_all
        self._session: aiohttp.ClientSession | None = None

    async def start(self, pod: dict[str, Any]) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        metadata, pod_ip = pod["metadata"], pod["status"]["podIP"]
        pod_dir = self.pods_dir / metadata["namespace"] / metadata["name"]
        pod_problem = _unsupported_pod_fields(pod)
        session = self._session

        def supervise(container: dict[str, Any], init: bool) -> ContainerSupervisor:
            try:
                if pod_problem:
                    raise UnsupportedPod(pod_problem)
                launch = build_launch(pod, container, pod_dir, empty_dirs(pod, pod_dir), self.kubeconfig)
                probes = [] if init else [p for kind in PROBE_FIELDS if (p := parse_probe(kind, container))]
            except UnsupportedPod as error:
                launch, probes = error, []
            return ContainerSupervisor(
                (metadata["namespace"], metadata["name"]),
                pod_ip,
                container,
                launch,
                probes,
                grace_s=pod["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE_S),
                log_path=pod_dir / f"{container['name']}.log",
                session=session,
                init=init,
            )

        running = RunningPod(
            metadata["namespace"],
            metadata["name"],
            [supervise(container, init=False) for container in pod["spec"]["containers"]],
            timestamp(),
            pod["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE_S),
            init=[supervise(container, init=True) for container in pod["spec"].get("initContainers", [])],
        )
        self._pods[metadata["uid"]] = running
        self._supervisors.extend(running.everything)
        task = asyncio.get_running_loop().create_task(self._initialize_then_start(running))
        self._stopping.add(task)  # awaited on close like a stop, so nothing outlives the runner
        task.add_done_callback(self._stopping.discard)

    @staticmethod
    async def _initialize_then_start(running: RunningPod) -> None:
        """Init containers one at a time, each to its successful exit; then the pod's containers."""
        for supervisor in running.init:
            supervisor.begin()
            await supervisor.finished()
            if not supervisor.completed:
                return  # stopped (the pod went away), or it could not run at all
        for supervisor in running.supervisors:
            supervisor.begin()

    def status(self, pod: dict[str, Any], previous: dict[str, Any]) -> dict[str, Any]:
        running = self._pods.get(pod["metadata"]["uid"])
        if running is None:
            return previous
        return pod_status(running, previous.get("podIP", ""), previous)

    async def stop(self, pod: dict[str, Any]) -> None:
        """The pod was deleted: its containers get SIGTERM now and SIGKILL after the grace period. Returns
        at once (the kubelet loop goes on); ``close`` waits for every stop still under way."""
        running = self._pods.pop(pod["metadata"]["uid"], None)
        if running is not None:
            self._stop_in_background(running, running.grace_s)

    def _stop_in_background(self, running: RunningPod, grace_s: float) -> None:
        task = asyncio.get_running_loop().create_task(self._stop_pod(running, grace_s))
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    @staticmethod
    async def _stop_pod(running: RunningPod, grace_s: float) -> None:
        await asyncio.gather(*(supervisor.stop(grace_s) for supervisor in running.everything))

    async def close(self) -> None:
        """The harness is shutting down: stop every pod (grace capped at ``shutdown_grace_s``) and wait."""
        for uid in list(self._pods):
            running = self._pods.pop(uid)
            self._stop_in_background(running, min(running.grace_s, self.shutdown_grace_s))
        if self._stopping:
            await asyncio.gather(*self._stopping, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def kill_all(self) -> None:
        """SIGKILL to every container process group this runner started; safe from any thread, for
        fixture finalizers that must not leave processes behind even when the event loop is stuck."""
        for supervisor in self._supervisors:
            supervisor.kill_now()

    def containers(self, namespace: str) -> list[ContainerSupervisor]:
        """Every container of every pod this runner started in ``namespace``, stopped ones included."""
        return [supervisor for supervisor in self._supervisors if supervisor.namespace == namespace]

    def log_tails(self, chars: int = 3000) -> str:
        """The end of every container log (container output and kubelet events), for failure reports."""
        parts = []
        for log in sorted(self.pods_dir.glob("*/*/*.log")):
            name = f"{log.parent.parent.name}/{log.parent.name}/{log.name}"
            parts.append(f"--- {name} ---\n{log.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)
