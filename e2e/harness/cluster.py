"""A whole emulated cluster on a background event loop, with a synchronous face for tests.

The API server, the workload controllers and the pod runner share one asyncio loop in a thread, so
subprocesses (``kopf run``, ``kubectl``) can talk to it over HTTP while plain synchronous tests inspect
and steer it through ``call``.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import kmock
import yaml
from harness.apiserver import ApiServerHarness
from harness.pod_runners import FakePodRunner
from harness.workloads import PodRunner, WorkloadControllers

T = TypeVar("T")
NAMESPACES = kmock.resource("", "v1", "namespaces")


def claim_ip_prefix() -> tuple[str, int]:
    """A random loopback 127.x.y (pods get 127.x.y.N) that no other live harness on this machine holds.

    The claim is an exclusive lock on a file named after the prefix, held until the returned descriptor
    is closed (or the process dies), so parallel test runs never give two pods the same address and port.
    """
    lock_dir = Path(tempfile.gettempdir()) / "kvpilot-e2e-addresses"
    lock_dir.mkdir(exist_ok=True)
    for _ in range(100):
        prefix = f"127.{random.randint(16, 250)}.{random.randint(0, 255)}"
        descriptor = os.open(lock_dir / prefix, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            continue
        return prefix, descriptor
    raise RuntimeError(f"no free loopback prefix after 100 tries (locks in {lock_dir})")


class HarnessCluster:
    def __init__(self, workdir: Path, runner: PodRunner | None = None) -> None:
        self.workdir = workdir
        self.runner = runner or FakePodRunner()
        self.ip_prefix, self._prefix_lock = claim_ip_prefix()
        self.kubeconfig = workdir / "kubeconfig"
        self.api: ApiServerHarness | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="harness-cluster", daemon=True)
        self._server: kmock.Server | None = None
        self._controllers: WorkloadControllers | None = None

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def start(self) -> HarnessCluster:
        self._thread.start()
        self.call(self._start())
        server = f"http://{self._server.host}:{self._server.port}"
        self.kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "harness",
                    "clusters": [{"name": "harness", "cluster": {"server": server}}],
                    "users": [{"name": "harness", "user": {"token": "harness-token"}}],
                    "contexts": [
                        {
                            "name": "harness",
                            "context": {"cluster": "harness", "user": "harness", "namespace": "default"},
                        }
                    ],
                }
            )
        )
        return self

    async def _start(self) -> None:
        self.api = ApiServerHarness()
        await self.api.__aenter__()
        self._server = kmock.Server(self.api)
        await self._server.__aenter__()
        self._controllers = WorkloadControllers(self.api, self.runner, self.ip_prefix)
        self._controllers.start()
        await self.api.create(NAMESPACES, None, {"metadata": {"name": "default"}})

    def stop(self) -> None:
        async def _stop() -> None:
            await self._controllers.stop()
            await self._server.__aexit__(None, None, None)
            await self.api.__aexit__(None, None, None)

        try:
            self.call(_stop(), timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            os.close(self._prefix_lock)

    # ---- reading and steering from tests ----------------------------------------------------------
    def get(self, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        async def _get() -> dict[str, Any] | None:
            return self.api.store.get((kmock.resource(resource), namespace, name))

        return self.call(_get())

    def list(self, resource: str, namespace: str | None) -> list[dict[str, Any]]:
        async def _list() -> list[dict[str, Any]]:
            return self.api.store.list(kmock.resource(resource), namespace)

        return self.call(_list())

    def history(self, resource: str, namespace: str | None, name: str) -> list[dict[str, Any]]:
        """Every stored version of an object (None marks a deletion)."""

        async def _history() -> list[dict[str, Any]]:
            key = (kmock.resource(resource), namespace, name)
            return (
                [None if v is None else dict(v) for v in self.api.objects[key].history]
                if key in self.api.objects
                else []
            )

        return self.call(_history())

    def create_namespace(self, name: str) -> None:
        self.call(self.api.create(NAMESPACES, None, {"metadata": {"name": name}}))

    def set_stage(self, namespace: str, stage: str, pods: list[str] | None = None) -> list[str]:
        """Put the named pods (default: every pod in the namespace) at a stage; returns their names."""
        names = pods or [pod["metadata"]["name"] for pod in self.list("v1/pods", namespace)]
        for name in names:
            self.runner.stages[name] = stage
        return names

    def wait_for(
        self, what: str, condition: Callable[[], T], timeout: float = 30.0, interval: float = 0.2
    ) -> T:
        """Poll until ``condition()`` is truthy; fail naming ``what`` and the last value seen."""
        deadline = time.monotonic() + timeout
        value = condition()
        while not value:
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {value!r})")
            time.sleep(interval)
            value = condition()
        return value
