"""Starting, waiting for and always stopping one benchmark server process (vLLM or kvpilot).

A server runs in its own session (process group), so stopping it also ends the workers it forked (vLLM's
engine core process); stop sends SIGTERM to the group, waits, then SIGKILLs it. ``ManagedServer`` is a
context manager, and the comparison script turns SIGTERM into an exception, so the server is stopped on
success, failure, Ctrl-C and a plain ``kill`` of the script alike.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

READY_POLL_INTERVAL_S = 0.5
STOP_GRACE_S = 15.0
LOG_TAIL_LINES = 25


class ServerError(RuntimeError):
    """A server that would not start, died, or did not become ready in time; the message says which."""


@dataclass(frozen=True)
class ServerSpec:
    name: str  # "vllm" or "kvpilot", used in file names and the table
    argv: list[str]  # the command line
    port: int
    ready_path: str  # polled until HTTP 200: vLLM's /health, kvpilot's /ready
    env: dict[str, str] = field(default_factory=dict)  # set on top of base_env
    base_env: dict[str, str] | None = None  # the environment it starts from (None: this process's)
    start_timeout_s: float = 600.0  # spawn to ready, including weight loading and compilation
    bench_args: tuple[str, ...] = ()  # extra `bench serve` flags it needs (llama.cpp: --no-keep-alive)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    """A port nothing listens on now (other engineers run servers on this machine too)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class ManagedServer:
    """One server process with its output in ``log_path``; use as ``with ManagedServer(...) as server``."""

    def __init__(self, spec: ServerSpec, log_path: Path):
        self.spec = spec
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        self.started_at = 0.0
        self.ready_after_s: float | None = None  # spawn -> first HTTP 200 on the ready path

    def __enter__(self) -> ManagedServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**(os.environ if self.spec.base_env is None else self.spec.base_env), **self.spec.env}
        with open(self.log_path, "wb") as log:
            try:
                # cwd: `python -m` puts it on sys.path, and at the repo root operator/ shadows the stdlib.
                self.process = subprocess.Popen(
                    self.spec.argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                    cwd=self.log_path.parent,
                )
            except OSError as exc:
                raise ServerError(f"{self.spec.name}: cannot run {self.spec.argv[0]}: {exc}") from None
        self.started_at = time.perf_counter()

    def wait_ready(self) -> float:
        """Poll the ready path until HTTP 200; returns seconds from spawn. Raises ServerError."""
        assert self.process is not None, "start() first"
        url = self.spec.base_url + self.spec.ready_path
        deadline = self.started_at + self.spec.start_timeout_s
        while time.perf_counter() < deadline:
            code = self.process.poll()
            if code is not None:
                raise ServerError(
                    f"{self.spec.name} exited with code {code} before it was ready; "
                    f"last lines of {self.log_path}:\n{log_tail(self.log_path)}"
                )
            if _answers_ok(url):
                self.ready_after_s = time.perf_counter() - self.started_at
                return self.ready_after_s
            time.sleep(READY_POLL_INTERVAL_S)
        raise ServerError(
            f"{self.spec.name} was not ready at {url} within {self.spec.start_timeout_s:g} s; "
            f"last lines of {self.log_path}:\n{log_tail(self.log_path)}"
        )

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it after a grace period; safe to call twice."""
        process, self.process = self.process, None
        if process is None:
            return
        _signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            _signal_group(process.pid, signal.SIGKILL)
            process.wait(timeout=STOP_GRACE_S)
        # Workers of the group may outlive the leader's exit; the group id is the leader's pid.
        _signal_group(process.pid, signal.SIGKILL)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _answers_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
