"""Pod runners for the harness kubelet: where a pod's containers stand, and who decides it.

``FakePodRunner`` runs no container: the test sets each pod's stage (pending, loading, warmingUp, ready,
crashing), and an HTTP endpoint on the pod's loopback address answers ``/ready`` with the engine's body
(``{"phase": ..., "progress": ...}``), so the operator reads warm-up progress exactly as from a real engine.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp.web

ENGINE_PHASES = {"loading": ("loading", 0.4), "warmingUp": ("warming_up", 0.9), "ready": ("ready", 1.0)}
log = logging.getLogger(__name__)


class FakePodRunner:
    def __init__(self, default_stage: str = "ready", engine_port: int = 8000) -> None:
        self.default_stage = default_stage
        self.engine_port = engine_port
        self.stages: dict[str, str] = {}  # pod name -> stage
        self.namespace_stages: dict[str, str] = {}  # namespace -> stage, for pods without their own
        self._sites: dict[str, aiohttp.web.AppRunner] = {}

    def stage(self, pod: dict[str, Any]) -> str:
        namespace_stage = self.namespace_stages.get(pod["metadata"].get("namespace", ""), self.default_stage)
        return self.stages.get(pod["metadata"]["name"], namespace_stage)

    async def start(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]

        async def ready(_: aiohttp.web.Request) -> aiohttp.web.Response:
            phase, progress = ENGINE_PHASES.get(self.stage(pod), ("loading", 0.0))
            return aiohttp.web.json_response({"phase": phase, "progress": progress},
                                             status=200 if phase == "ready" else 503)

        app = aiohttp.web.Application()
        app.router.add_get("/ready", ready)
        runner = aiohttp.web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await aiohttp.web.TCPSite(runner, pod["status"]["podIP"], self.engine_port).start()
        except OSError as error:
            # Someone holds the port on every address; the operator then reads the pod's own signals.
            log.warning("pod %s: cannot serve /ready on %s:%s: %s", name, pod["status"]["podIP"],
                        self.engine_port, error)
            await runner.cleanup()
            return
        self._sites[name] = runner

    async def stop(self, pod: dict[str, Any]) -> None:
        runner = self._sites.pop(pod["metadata"]["name"], None)
        if runner is not None:
            await runner.cleanup()
