"""Readiness and shutdown: phases and 503s before the engine is ready, startup phases as metrics, and the
SIGTERM drain (``/ready`` 503, new requests 503, in-flight requests finish, exit 0; after the grace period
the stragglers are cancelled)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from kvpilot.engine.engine_args import EngineArgs
from kvpilot.engine.server.config import ServerConfig, WarmupBucket
from kvpilot.engine.server.drain import drain

pytestmark = pytest.mark.e2e
MODEL = "tiny-random"


def test_not_ready_until_the_engine_has_loaded_and_warmed_up(start_in_process):
    gate = threading.Event()
    engine_config = EngineArgs(model="tiny-random", num_kv_blocks=64).create_config()

    def gated_engine():
        from kvpilot.engine.engine_core import LLMEngine

        assert gate.wait(30)
        return LLMEngine(engine_config)

    config = ServerConfig(warmup_buckets=(WarmupBucket(1, 8), WarmupBucket(2, 16)))
    server = start_in_process({"num_kv_blocks": 64}, config, wait=False, engine_factory=gated_engine)
    ready = httpx.get(server.url + "/ready")
    assert ready.status_code == 503
    assert {k: ready.json()[k] for k in ("model", "phase", "ready")} == {
        "model": MODEL,
        "phase": "loading",
        "ready": False,
    }
    assert httpx.get(server.url + "/health").status_code == 503  # the startup probe waits out the loading
    load = httpx.get(server.url + "/load").json()
    assert (load["ready"], load["phase"], load["epoch"], load["kv_blocks_total"]) == (False, "loading", "", 0)
    assert httpx.get(server.url + "/kv/events").status_code == 503
    with pytest.raises(openai.InternalServerError) as exc:
        server.client().completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert (exc.value.status_code, exc.value.code) == (503, "not_ready")
    assert exc.value.response.headers["retry-after"] == "1"
    gate.set()
    # loading may compile the native CPU kernels into a fresh cache first: 31 s on a loaded 2-core host
    deadline = time.monotonic() + 180
    while (ready := httpx.get(server.url + "/ready")).status_code != 200:
        assert time.monotonic() < deadline
    body = ready.json()
    assert (body["phase"], body["ready"]) == ("ready", True)
    assert sorted(body["startup_seconds"]) == ["loading", "warming_up"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "phase": "ready"}
    assert server.client().completions.create(model=MODEL, prompt="x", max_tokens=1).choices
    metrics = httpx.get(server.url + "/metrics").text
    for phase in ("loading", "warming_up"):
        assert f'kvpilot_startup_phase_seconds_count{{model_name="{MODEL}",phase="{phase}"}} 1.0' in metrics


def test_sigterm_drains_in_flight_requests_and_exits_zero(start_process):
    server = start_process(
        [
            "--model",
            "tiny-random",
            "--num-kv-blocks",
            "256",
            "--warmup-buckets",
            "none",
            "--drain-grace-seconds",
            "60",
        ]
    )
    client = server.client()
    stream = iter(
        client.completions.create(
            model=MODEL,
            prompt="drain me",
            max_tokens=240,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    next(stream)
    server.signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while (ready := server.get("/ready")).status_code == 200:
        assert time.monotonic() < deadline
    assert (ready.status_code, ready.json()["phase"]) == (503, "draining")
    assert server.get("/health").status_code == 200
    load = server.get("/load").json()
    assert (load["ready"], load["phase"], load["running"]) == (False, "draining", 1)
    with pytest.raises(openai.InternalServerError) as exc:
        client.completions.create(model=MODEL, prompt="late", max_tokens=1)
    assert (exc.value.status_code, exc.value.code) == (503, "draining")
    rest = list(stream)
    assert rest[-2].choices[0].finish_reason == "length" and rest[-1].usage.completion_tokens == 240
    assert server.process.wait(20) == 0


def test_grace_period_over_cancels_what_is_left(start_in_process):
    server = start_in_process({"num_kv_blocks": 64})
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={"prompt": "slow", "max_tokens": 480, "stream": True, "ignore_eos": True},
    ) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        asyncio.run(drain(server.state, grace_s=0.2))
        events = [line for line in lines if line]
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert (error["code"], events[-1]) == ("draining", "data: [DONE]")
    assert server.state.inflight == 0 and server.state.lifecycle.phase.value == "draining"


def test_an_address_that_cannot_be_bound_exits_1_in_one_line():
    kvpilot = os.path.join(os.path.dirname(sys.executable), "kvpilot")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 18732))
        taken.listen()
        args = [
            "--model",
            "tiny-random",
            "--warmup-buckets",
            "none",
            "--host",
            "127.0.0.1",
            "--port",
            "18732",
        ]
        done = subprocess.run([kvpilot, "serve", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr  # uvicorn's own status was 3
    assert "error while attempting to bind on address ('127.0.0.1', 18732)" in done.stderr
    assert "Traceback" not in done.stderr
