"""What the kubelet does for one container: run it, restart it with back-off, probe it, report its status.

- **Restarts** (the pod's restartPolicy is Always for Deployments): the first exit restarts at once, then
  the kubelet waits 10 s, 20 s, 40 s, … up to 300 s (``CrashLoopBackOff``); a container that ran for
  10 minutes since its last restart starts over at no delay. ``restartCount`` counts the restarts.
- **Probes**: each probe ticks every ``periodSeconds`` from the moment the pod starts; a tick does nothing
  before ``initialDelaySeconds`` of the current container, liveness and readiness wait until the startup
  probe has passed, and the startup probe stops once it has. When the container becomes started, the
  readiness probe runs at once instead of waiting for its tick. A failed liveness or startup verdict
  stops the container (SIGTERM, SIGKILL after the grace period) and the restart policy brings it back.
- **Status**: ``state``/``lastState`` (waiting, running, terminated with exit code and reason),
  ``started``, ``ready``, ``restartCount`` and ``containerID`` (``process://<pid>``); with
  ``terminationMessagePolicy: FallbackToLogsOnError`` a failed run's ``message`` is the end of its output.
- **Init containers** (``init=True``): done once a run exits 0; a failed run restarts with the same
  back-off (the pod's restartPolicy is Always).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from harness.container_launch import LaunchSpec
from harness.container_process import ContainerProcess, Exit, timestamp
from harness.probes import LIVENESS, READINESS, STARTUP, ProbeSpec, ProbeVerdict, UnsupportedPod, check


class RestartBackoff:
    """The kubelet's per-container restart back-off, on the monotonic clock (seconds)."""

    INITIAL_S, MAX_S = 10.0, 300.0
    STABLE_S = 2 * MAX_S  # a container that ran this long since its last restart starts over

    def __init__(self) -> None:
        self.current: float | None = None
        self._last_restart: float | None = None

    def _expired(self, finished: float) -> bool:
        return self.current is None or finished - self._last_restart > self.STABLE_S

    def delay(self, finished: float, now: float) -> float:
        """Seconds still to wait before restarting a container that exited at ``finished``."""
        return 0.0 if self._expired(finished) else max(0.0, self.current - (now - finished))

    def restarting(self, finished: float, now: float) -> None:
        self.current = self.INITIAL_S if self._expired(finished) else min(2 * self.current, self.MAX_S)
        self._last_restart = now


class ContainerSupervisor:
    def __init__(
        self,
        pod: tuple[str, str],
        pod_ip: str,
        container: dict[str, Any],
        launch: LaunchSpec | UnsupportedPod,
        probes: list[ProbeSpec],
        grace_s: float,
        log_path: Path,
        session: aiohttp.ClientSession,
        clock: Callable[[], float] = time.monotonic,
        init: bool = False,
    ) -> None:
        """``pod`` is (namespace, name); ``launch`` is the process to run, or why none can run; ``init``:
        an init container, done once it exits 0 (it is restarted only after a failure)."""
        self.name, self.image = container["name"], container.get("image", "")
        (self.namespace, self.pod_name), self.pod_ip = pod, pod_ip
        self.pids: list[int] = []  # every process this container ever had
        self._launch, self._grace_s, self._log_path, self._session, self._clock = (
            launch,
            grace_s,
            log_path,
            session,
            clock,
        )
        self.verdicts = {probe.kind: ProbeVerdict(probe) for probe in probes}
        self._triggers = {probe.kind: asyncio.Event() for probe in probes}
        self.current: ContainerProcess | None = None
        self.container_id: str | None = None
        self.restart_count = 0
        self.state: dict[str, Any] = {"waiting": {"reason": "ContainerCreating"}}
        self.last_state: dict[str, Any] = {}
        self._started_clock = 0.0
        self._backoff = RestartBackoff()
        self.init, self.completed = init, False
        self._fallback_to_logs = container.get("terminationMessagePolicy") == "FallbackToLogsOnError"
        self._stopping = False
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._lifecycle: asyncio.Task[None] | None = None
        if isinstance(launch, UnsupportedPod):
            self.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(launch)}}

    # ---- status --------------------------------------------------------------------------------------
    def _verdict(self, kind: str) -> bool | None:
        """The current container's verdict; None for a kind without a probe."""
        verdict = self.verdicts.get(kind)
        if verdict is None:
            return None
        return verdict.value if verdict.container_id == self.container_id else False

    @property
    def ever_ran(self) -> bool:
        return self.container_id is not None

    @property
    def started(self) -> bool:
        """Running, and past its startup probe if it has one."""
        if self.current is None or not self.current.running:
            return False
        return STARTUP not in self.verdicts or self._verdict(STARTUP) is True

    @property
    def ready(self) -> bool:
        return self.started and (READINESS not in self.verdicts or self._verdict(READINESS) is True)

    def status(self) -> dict[str, Any]:
        status = {
            "name": self.name,
            "image": self.image,
            "imageID": "",
            "state": self.state,
            "lastState": self.last_state,
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
        }
        if self.container_id:
            status["containerID"] = self.container_id
        return status

    def _event(self, message: str) -> None:
        """What a kubelet would record as an Event, written into the container's log where it happened."""
        with self._log_path.open("a") as log:
            log.write(f"==> {timestamp()} kubelet: {message}\n")

    # ---- lifecycle -----------------------------------------------------------------------------------
    def begin(self) -> None:
        if isinstance(self._launch, UnsupportedPod):
            return  # stays in CreateContainerConfigError: nothing to run, nothing to probe
        self._lifecycle = asyncio.get_running_loop().create_task(self._run())
        self._tasks = [
            asyncio.get_running_loop().create_task(self._probe_loop(verdict))
            for verdict in self.verdicts.values()
        ]

    async def _run(self) -> None:
        assert isinstance(self._launch, LaunchSpec)
        while True:
            banner = f"container {self.name} of pod {self.pod_name}, start {self.restart_count + 1}"
            output_from = self._log_path.stat().st_size if self._log_path.exists() else 0
            process = await ContainerProcess.start(self._launch, self._log_path, banner)
            self.current, self._started_clock = process, self._clock()
            if process.pid is not None:
                self.pids.append(process.pid)
            self.container_id = f"process://{process.pid or f'failed-{self.restart_count}'}"
            if process.running:
                self.state = {"running": {"startedAt": process.started_at}}
                if STARTUP not in self.verdicts and READINESS in self._triggers:
                    self._triggers[READINESS].set()  # started as it runs: readiness is asked at once
            if self._stopping:
                await process.stop(self._grace_s)
                return
            exited: Exit = await process.wait()
            finished = self._clock()
            if exited.code != 0 and self._fallback_to_logs and not exited.message:
                exited = dataclasses.replace(exited, message=self._output_tail(output_from))
            self._event(f"container {self.name} exited with code {exited.code} ({exited.reason})")
            self.state = {"terminated": exited.as_state()}
            if self._stopping:
                return
            if self.init and exited.code == 0:
                self.completed = True
                return
            delay = self._backoff.delay(finished, self._clock())
            if delay > 0:
                self.state = {
                    "waiting": {
                        "reason": "CrashLoopBackOff",
                        "message": (
                            f"back-off {self._backoff.current:g}s restarting failed container={self.name} "
                            f"pod={self.pod_name}"
                        ),
                    }
                }
                self.last_state = {"terminated": exited.as_state()}
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
                if self._stopping:
                    return
            self._backoff.restarting(finished, self._clock())
            self.last_state = {"terminated": exited.as_state()}
            self.restart_count += 1

    def _output_tail(self, offset: int) -> str:
        """``FallbackToLogsOnError``: the kubelet's termination message is the end of the container's
        output (its last 80 lines, at most 2048 bytes); the kubelet's own lines here are not output."""
        with self._log_path.open("rb") as log:
            log.seek(offset)
            lines = log.read().decode(errors="replace").splitlines()
        output = [line for line in lines if not line.startswith("==> ")][-80:]
        return "\n".join(output).encode()[-2048:].decode(errors="ignore")

    async def finished(self) -> None:
        """Wait until the container's lifecycle ended: an init container completed, or it was stopped."""
        if self._lifecycle is not None:
            await asyncio.shield(self._lifecycle)

    async def _probe_loop(self, verdict: ProbeVerdict) -> None:
        loop = asyncio.get_running_loop()
        trigger, next_tick = self._triggers[verdict.spec.kind], loop.time()
        while not self._stopping:
            await self._probe_once(verdict)
            while next_tick <= loop.time():  # a ticker drops the ticks a slow check missed
                next_tick += verdict.spec.period_s
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(trigger.wait(), next_tick - loop.time())
            trigger.clear()

    async def _probe_once(self, verdict: ProbeVerdict) -> None:
        spec, process, container_id = verdict.spec, self.current, self.container_id
        if process is None or container_id is None:
            return  # not created yet
        verdict.follow(container_id)
        if verdict.on_hold:
            return
        if not process.running:
            verdict.value = False
            return
        if self._clock() - self._started_clock < spec.initial_delay_s:
            return
        if (spec.kind == STARTUP) == self.started:
            return  # startup probes stop once started; the others wait for it
        passed = await check(spec.action, self.pod_ip, spec.timeout_s, self._session)
        if self.container_id != container_id or self._stopping:
            return  # the container was replaced while the check ran: its result is stale
        was_started, before = self.started, verdict.value
        verdict.record(passed)
        if not passed:
            in_a_row = spec.failure_threshold if verdict.on_hold else verdict.failures_in_a_row
            self._event(f"{spec.kind} probe failed ({in_a_row} in a row)")
        elif verdict.value is not before:
            self._event(f"{spec.kind} probe passed")
        if verdict.on_hold and spec.kind in (LIVENESS, STARTUP):
            self._event(f"container {self.name} failed its {spec.kind} probe and will be restarted")
            grace = spec.termination_grace_s if spec.termination_grace_s is not None else self._grace_s
            self._tasks.append(asyncio.get_running_loop().create_task(process.stop(grace)))
        if self.started and not was_started and READINESS in self._triggers:
            self._triggers[READINESS].set()

    async def stop(self, grace_s: float) -> None:
        """Stop for good (the pod is going away): no more restarts or probes; SIGTERM, SIGKILL after grace."""
        self._stopping = True
        self._wake.set()
        for task in self._tasks:
            task.cancel()
        if self.current is not None:
            await self.current.stop(grace_s)
        if self._lifecycle is not None:
            await self._lifecycle

    def kill_now(self) -> None:
        """Last resort from outside the event loop: SIGKILL whatever runs, no waiting."""
        self._stopping = True
        if self.current is not None:
            self.current.kill_group()
