"""Live engine servers for the server tests.

- ``ServerProcess``: ``kvpilot serve`` as a subprocess on a free port (the real CLI, signals, exit status);
  it inherits ``KVPILOT_CACHE_DIR`` (the session's model cache) from the environment.
- ``InProcessServer``: the same app under uvicorn on a thread of the test process, for tests that need to
  reach inside (an in-memory span exporter, a gated engine factory, a small KV event log) or that should
  not pay a second process start.
- ``tiny_server``: one subprocess server on the tiny model for the whole session (API key, 64 KiB body
  limit, SLOs of 60 s), shared by the API, metrics, cancellation and KV-event tests.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from kvpilot.engine.config import EngineArgs
from kvpilot.engine.server.app import build_state, create_app
from kvpilot.engine.server.config import ServerConfig, WarmupBucket
from kvpilot.engine.tokenizer import Tokenizer

API_KEY = "sk-kvpilot-test"
TINY_ARGS = ["--model", "tiny-random", "--num-kv-blocks", "512", "--warmup-buckets", "1x8,2x16"]


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
        cmd = [sys.executable, "-m", "kvpilot.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               *args, *(["--api-key", api_key] if api_key else [])]
        # run from the log's folder: a `python -m` in the repo root would put its `operator/` folder first
        # on sys.path (see scripts/setup.sh)
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=dict(os.environ),
                                        cwd=log_path.parent)

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


class InProcessServer:
    """The app under uvicorn on a background thread; ``state`` is the live ``ServerState``."""

    def __init__(self, engine_args: dict, config: ServerConfig | None = None, **build_kwargs) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        engine_args = {"model": "tiny-random", "num_kv_blocks": 256, **engine_args}
        engine_config = EngineArgs.from_kwargs(**engine_args).create_config()
        self.config = config or ServerConfig(warmup_buckets=(WarmupBucket(1, 8),))
        self.state = build_state(engine_config, self.config, **build_kwargs)
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.state), host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, wait: bool = True) -> InProcessServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("in-process server did not start")
            time.sleep(0.02)
        if wait:
            wait_ready(self.url, 60)
        return self

    def client(self, api_key: str = "unused", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60, **kwargs)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(30)

    def __enter__(self) -> InProcessServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("tiny-server") / "server.log"
    server = ServerProcess([*TINY_ARGS, "--max-body-bytes", "65536", "--slo-ttft", "60", "--slo-tpot", "60"],
                           log, api_key=API_KEY).wait_ready()
    yield server
    assert server.stop() == 0, server.log_path.read_text()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture
def client(tiny_server: ServerProcess) -> openai.OpenAI:
    return tiny_server.client()


@pytest.fixture(scope="module")
def start_process(tiny_model_dir: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProcess]]:
    """Factory: ``start_process(args, api_key=None, wait=True)``; every server is stopped after the module."""
    started: list[ServerProcess] = []

    def start(args: list[str], api_key: str | None = None, wait: bool = True) -> ServerProcess:
        server = ServerProcess(args, tmp_path_factory.mktemp("server") / "server.log", api_key)
        started.append(server)
        return server.wait_ready() if wait else server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def start_in_process(tiny_model_dir: Path) -> Iterator[Callable[..., InProcessServer]]:
    """Factory: ``start_in_process(engine_args, config, wait=True, **build_state_kwargs)``; stopped after
    the module."""
    started: list[InProcessServer] = []

    def start(engine_args: dict | None = None, config: ServerConfig | None = None, wait: bool = True,
              **build_kwargs) -> InProcessServer:
        server = InProcessServer(engine_args or {}, config, **build_kwargs)
        started.append(server)
        return server.start(wait)

    yield start
    for server in started:
        server.stop()
