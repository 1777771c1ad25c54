"""One run of a container as a local process: spawn, wait, signal, and the exit as a runtime reports it.

Each run gets its own process group, which stands in for the container's cgroup: a stop sends SIGTERM to
the main process only (what a container runtime does), and SIGKILL to the whole group, so nothing the
container started outlives it. When the main process exits on its own, the rest of its group is killed
too, as the kernel does to a PID namespace whose init exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from harness.container_launch import LaunchSpec

START_ERROR_EXIT_CODE = 128  # what runc reports when the executable cannot be started


def timestamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Exit:
    code: int
    reason: str  # Completed, Error or StartError
    message: str
    started_at: str
    finished_at: str

    def as_state(self) -> dict[str, object]:
        state: dict[str, object] = {
            "exitCode": self.code,
            "reason": self.reason,
            "startedAt": self.started_at,
            "finishedAt": self.finished_at,
        }
        if self.message:
            state["message"] = self.message
        return state


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode  # killed by signal N: 128 + N, as runtimes say


class ContainerProcess:
    """A started container process; ``start`` raises nothing, a failed exec becomes an ``Exit``."""

    def __init__(
        self, process: asyncio.subprocess.Process | None, started_at: str, start_error: str = ""
    ) -> None:
        self.process = process
        self.started_at = started_at
        self._start_error = start_error

    @classmethod
    async def start(cls, launch: LaunchSpec, log_path: Path, banner: str) -> ContainerProcess:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            log.write(f"==> {timestamp()} {banner}: {' '.join(launch.argv)}\n".encode())
            log.flush()
            try:
                process = await asyncio.create_subprocess_exec(
                    *launch.argv,
                    env=launch.env,
                    cwd=launch.cwd,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    process_group=0,
                )
            except OSError as error:
                message = f"failed to start {launch.argv[0]!r}: {error.strerror or error}"
                log.write(f"==> {message}\n".encode())
                return cls(None, timestamp(), message)
        return cls(process, timestamp())

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def wait(self) -> Exit:
        if self.process is None:
            return Exit(START_ERROR_EXIT_CODE, "StartError", self._start_error, self.started_at, timestamp())
        returncode = await self.process.wait()
        self.kill_group()  # whatever the container left behind goes with it
        code = _exit_code(returncode)
        return Exit(code, "Completed" if code == 0 else "Error", "", self.started_at, timestamp())

    def terminate(self) -> None:
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)

    def kill_group(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)

    async def stop(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL to the group once ``grace_s`` has passed; returns when the process is
        gone."""
        if not self.running:
            self.kill_group()
            return
        self.terminate()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.process.wait()), grace_s)
        self.kill_group()
        await self.process.wait()
