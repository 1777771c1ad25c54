"""Live engine servers for the server tests.

- ``ServerProcess`` (``tests/support/live_server.py``): ``kvpilot serve`` as a subprocess on a free port.
- ``InProcessServer``: the same app under uvicorn on a thread of the test process, for tests that need to
  reach inside (an in-memory span exporter, a gated engine factory, a small KV event log) or that should
  not pay a second process start.
- ``tiny_server``: one subprocess server on the tiny model for the whole session (API key, 64 KiB body
  limit, SLOs of 60 s), shared by the API, metrics, cancellation and KV-event tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
import uvicorn
from live_server import ServerProcess, free_port, wait_ready

from kvpilot.engine.engine_args import EngineArgs
from kvpilot.engine.server.app import build_state, create_app
from kvpilot.engine.server.config import ServerConfig, WarmupBucket
from kvpilot.engine.server.http_protocol import http_protocol
from kvpilot.engine.tokenizer import Tokenizer

API_KEY = "sk-kvpilot-test"
#: the session server's router token: tests that name tenants with x-tenant send it, as the router does
ROUTER_TOKEN = "router-token-for-tests-0123456789"
TRUSTED = {"x-kvpilot-router-token": ROUTER_TOKEN}
TINY_ARGS = ["--model", "tiny-random", "--num-kv-blocks", "512", "--warmup-buckets", "1x8,2x16"]


class InProcessServer:
    """The app under uvicorn on a background thread; ``state`` is the live ``ServerState``."""

    def __init__(self, engine_args: dict, config: ServerConfig | None = None, **build_kwargs) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        engine_args = {"model": "tiny-random", "num_kv_blocks": 256, **engine_args}
        engine_config = EngineArgs.from_kwargs(**engine_args).create_config()
        self.config = config or ServerConfig(warmup_buckets=(WarmupBucket(1, 8),))
        self.state = build_state(engine_config, self.config, **build_kwargs)
        self.server = uvicorn.Server(
            uvicorn.Config(
                create_app(self.state),
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                lifespan="on",
                http=http_protocol(self.config.connection_limits, self.config.body_read_timeout_s),
            )
        )
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, wait: bool = True) -> InProcessServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("in-process server did not start")
            time.sleep(0.02)
        if wait:
            wait_ready(self.url, 180)  # the first load may compile the native kernels into a fresh cache
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
    server = ServerProcess(
        [
            *TINY_ARGS,
            "--max-body-bytes",
            "65536",
            "--slo-ttft",
            "60",
            "--slo-tpot",
            "60",
            "--router-token",
            ROUTER_TOKEN,
        ],
        log,
        api_key=API_KEY,
    ).wait_ready()
    yield server
    assert server.stop() == 0, server.log_path.read_text()


@pytest.fixture(scope="session")
def router_headers() -> dict[str, str]:
    """Headers that make ``tiny_server`` believe ``x-tenant``, as the router sidecar's token does."""
    return dict(TRUSTED)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture
def client(tiny_server: ServerProcess) -> openai.OpenAI:
    return tiny_server.client()


@pytest.fixture(scope="module")
def start_process(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., ServerProcess]]:
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

    def start(
        engine_args: dict | None = None, config: ServerConfig | None = None, wait: bool = True, **build_kwargs
    ) -> InProcessServer:
        server = InProcessServer(engine_args or {}, config, **build_kwargs)
        started.append(server)
        return server.start(wait)

    yield start
    for server in started:
        server.stop()
