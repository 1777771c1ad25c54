"""``kvpilot serve`` as a live subprocess for tests: a free port, the wait for ``/ready``, and
``ServerProcess`` (the real CLI, signals, exit status). Shared by the server and router tests; importable
because ``tests/conftest.py`` puts this folder on ``sys.path``.

A server inherits ``KVPILOT_CACHE_DIR`` (the session's model cache) from the environment.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"server at {url} exited before it was ready")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url}/ready was not 200 within {timeout_s} s")


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        cmd = [
            sys.executable,
            "-m",
            "kvpilot.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *args,
            *(["--api-key", api_key] if api_key else []),
        ]
        # run from the log's folder: a `python -m` in the repo root would put its `operator/` folder first
        # on sys.path (see scripts/setup.sh)
        self.process = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=dict(os.environ), cwd=log_path.parent
        )

    def wait_ready(self, timeout_s: float = 90) -> ServerProcess:
        try:
            wait_ready(self.url, timeout_s, lambda: self.process.poll() is None)
        except (RuntimeError, TimeoutError):
            self.stop()
            raise RuntimeError("server did not become ready; log:\n" + self.log_path.read_text()) from None
        return self

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("api_key", self.api_key or "unused")
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, timeout=60, **kwargs)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers, timeout=30)

    def post(self, path: str, json: dict, headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.post(self.url + path, json=json, headers={**self.headers, **(headers or {})}, timeout=60)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.process.send_signal(sig)

    def stop(self, timeout_s: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode
