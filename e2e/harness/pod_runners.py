"""``FakePodRunner``: the harness kubelet's pods run no container; the test decides where each one stands.

The test sets each pod's stage (pending, loading, warmingUp, ready, crashing) and the runner reports the
pod status a kubelet would write for it; an HTTP endpoint on the pod's loopback address answers ``/ready``
with the engine's body (``{"phase": ..., "progress": ...}``), so the operator reads warm-up progress
exactly as from a real engine, and ``/metrics`` with what the test's ``metrics`` function writes for the
pod (the engine's exposition format; the autoscaler's input). ``process_runner.ProcessPodRunner`` is the
one that runs real processes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import aiohttp.web
from harness.store import now_timestamp

STAGES = ("pending", "loading", "warmingUp", "ready", "crashing")
ENGINE_PHASES = {"loading": ("loading", 0.4), "warmingUp": ("warming_up", 0.9), "ready": ("ready", 1.0)}
log = logging.getLogger(__name__)


def pod_status(pod: dict[str, Any], stage: str, previous: dict[str, Any]) -> dict[str, Any]:
    """The status a kubelet would write for a pod whose engine is at ``stage``."""
    ready = stage == "ready"
    was_ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in previous.get("conditions", [])
    )
    since = next(
        (c["lastTransitionTime"] for c in previous.get("conditions", []) if c["type"] == "Ready"), None
    )
    ready_since = since if was_ready == ready and since else now_timestamp()
    statuses = []
    for container in pod["spec"]["containers"]:
        if stage == "pending":
            state: dict[str, Any] = {"waiting": {"reason": "ContainerCreating"}}
        elif stage == "crashing" and container["name"] == "engine":
            state = {
                "waiting": {"reason": "CrashLoopBackOff", "message": "back-off restarting failed container"}
            }
        else:
            state = {"running": {"startedAt": pod["metadata"]["creationTimestamp"]}}
        engine_like = container["name"] == "engine"
        statuses.append(
            {
                "name": container["name"],
                "image": container.get("image", ""),
                "state": state,
                "ready": ready,
                "restartCount": 3 if stage == "crashing" and engine_like else 0,
                "started": stage in ("warmingUp", "ready") or (not engine_like and stage != "pending"),
            }
        )
    return {
        "phase": "Pending" if stage == "pending" else "Running",
        "podIP": previous.get("podIP", ""),
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": ready_since},
            {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": ready_since},
        ],
        "containerStatuses": statuses,
    }


class FakePodRunner:
    def __init__(self, default_stage: str = "ready", engine_port: int = 8000) -> None:
        self.default_stage = default_stage
        self.engine_port = engine_port
        self.stages: dict[str, str] = {}  # pod name -> stage
        self.namespace_stages: dict[str, str] = {}  # namespace -> stage, for pods without their own
        self._sites: dict[str, aiohttp.web.AppRunner] = {}
        #: pod -> the text its engine's /metrics answers (None: 404, as a pod without one)
        self.metrics: Callable[[dict[str, Any]], str] | None = None

    def stage(self, pod: dict[str, Any]) -> str:
        namespace_stage = self.namespace_stages.get(pod["metadata"].get("namespace", ""), self.default_stage)
        return self.stages.get(pod["metadata"]["name"], namespace_stage)

    def status(self, pod: dict[str, Any], previous: dict[str, Any]) -> dict[str, Any]:
        return pod_status(pod, self.stage(pod), previous)

    async def start(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]

        async def ready(_: aiohttp.web.Request) -> aiohttp.web.Response:
            phase, progress = ENGINE_PHASES.get(self.stage(pod), ("loading", 0.0))
            return aiohttp.web.json_response(
                {"phase": phase, "progress": progress}, status=200 if phase == "ready" else 503
            )

        async def engine_metrics(_: aiohttp.web.Request) -> aiohttp.web.Response:
            if self.metrics is None:
                raise aiohttp.web.HTTPNotFound()
            return aiohttp.web.Response(text=self.metrics(pod), content_type="text/plain")

        app = aiohttp.web.Application()
        app.router.add_get("/ready", ready)
        app.router.add_get("/metrics", engine_metrics)
        runner = aiohttp.web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await aiohttp.web.TCPSite(runner, pod["status"]["podIP"], self.engine_port).start()
        except OSError as error:
            # Someone holds the port on every address; the operator then reads the pod's own signals.
            log.warning(
                "pod %s: cannot serve /ready on %s:%s: %s",
                name,
                pod["status"]["podIP"],
                self.engine_port,
                error,
            )
            await runner.cleanup()
            return
        self._sites[name] = runner

    async def stop(self, pod: dict[str, Any]) -> None:
        runner = self._sites.pop(pod["metadata"]["name"], None)
        if runner is not None:
            await runner.cleanup()

    async def close(self) -> None:
        for name in list(self._sites):
            await self._sites.pop(name).cleanup()
