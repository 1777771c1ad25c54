"""Fixtures for the router tests: fake engine replicas and in-process routers, on the test's event loop.

A fake engine speaks the engine ⇄ router contract (docs/engine-router-contract.md) over real HTTP: it
derives prompt ids and block hashes with the same shared functions as the real engine, holds a prefix
cache, publishes ``/kv/events`` and ``/kv/snapshot``, reports ``/load`` from its own queue, and streams SSE.
Its behaviour (prefill time per uncached token, status to answer, hanging, readiness, overridden ``/load``
fields, dropping a request unanswered, an oversize answer header) is a mutable :class:`FakeEngineBehavior`;
``crash()`` drops every connection and the listener. A body it cannot derive a prompt from gets a 400
OpenAI error, as from the real engine.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict

from kvpilot.engine.kv.block_hash import block_hashes, encode_extra_keys, root_hash
from kvpilot.engine.prompt_render import chat_prompt_ids, completion_prompt_ids
from kvpilot.engine.tenancy import TenantPolicy, resolve_tenant
from kvpilot.engine.tokenizer import Tokenizer
from kvpilot.router.app import RouterApp
from kvpilot.router.config import DiscoveryConfig, PollConfig, RouterConfig, ScoringWeights, UpstreamConfig
from kvpilot.router.request_profile import RequestProfiler
from kvpilot.router.server import RouterServer, load_profiler

FAKE_ROOT = root_hash("fake-engine-model")  # every fake serves the same model: one hash chain root
#: what deriving a prompt from a client's JSON can raise (a fake engine answers 400 to all of it)
BAD_INPUT = (ValueError, TypeError, LookupError, RecursionError, ArithmeticError)


@dataclass
class FakeEngineBehavior:
    block_size: int = 16
    prefill_s_per_token: float = 0.0  # prefill time per uncached prompt token
    first_byte_s: float = 0.0  # fixed wait before the first token
    token_delay_s: float = 0.001  # between output tokens
    output_tokens: int = 3
    ready: bool = True
    caching: bool = True  # keep computed prompt blocks (and publish them)
    cache_blocks: int = 100_000  # prefix-cache capacity; the least recently used blocks go first
    inference_status: int = 200  # answer inference requests with this status instead (e.g. 503)
    hang: bool = False  # never answer inference requests
    load: dict[str, Any] = field(default_factory=dict)  # /load fields to override
    load_delay_s: float = 0.0  # /load answers this late
    tear_stream: bool = False  # after the tokens of a stream, write half an event and drop the connection
    drop_unanswered: bool = False  # read an inference request, then close its connection without answering
    header_bytes: int = 0  # a non-streamed answer carries an ``x-big`` header of this many bytes
    tenancy: TenantPolicy = field(default_factory=TenantPolicy)  # how it derives tenants (e.g. with API keys)


class FakeEngine:
    def __init__(self, tokenizer: Tokenizer, behavior: FakeEngineBehavior) -> None:
        self.tokenizer = tokenizer
        self.behavior = behavior
        self.epoch = uuid.uuid4().hex
        self.cached: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self.events: list[dict[str, Any]] = []
        self.received: list[tuple[str, CIMultiDict[str], dict[str, Any]]] = []  # path, headers, body
        self.first_bytes: set[str] = set()  # x-request-id of requests that got a first byte from here
        self.cancelled = 0  # inference handlers cancelled by a client disconnect
        self.inference_peers: list[Any] = []  # the client address of each inference request's connection
        self.prompt_tokens = self.cached_prompt_tokens = 0  # over all inference requests served
        self.waiting = self.running = self.queued_prefill_tokens = 0
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def seq(self) -> int:
        return self.events[-1]["seq"] if self.events else 0

    async def start(self, port: int = 0) -> FakeEngine:
        app = web.Application()
        for path, handler in (
            ("/health", self._health),
            ("/ready", self._ready),
            ("/load", self._load),
            ("/kv/events", self._events),
            ("/kv/snapshot", self._snapshot),
            ("/v1/models", self._models),
        ):
            app.router.add_get(path, handler)
        app.router.add_post("/v1/completions", self._inference)
        app.router.add_post("/v1/chat/completions", self._inference)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, "127.0.0.1", port)
        await self._site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def crash(self) -> None:
        """Die like a killed process: stop listening and reset every open connection."""
        assert self._runner is not None and self._site is not None
        await self._site.stop()
        for connection in list(self._runner.server.connections):
            if connection.transport is not None:
                connection.transport.abort()
        await self.stop()

    def store(self, hashes: list[bytes]) -> None:
        new = [h for h in hashes if h not in self.cached]
        for h in hashes:
            self.cached[h] = None
            self.cached.move_to_end(h)
        evicted = []
        while len(self.cached) > self.behavior.cache_blocks:
            evicted.append(self.cached.popitem(last=False)[0])
        for kind, changed in (("stored", new), ("removed", evicted)):
            if changed:
                self.events.append(
                    {"seq": self.seq + 1, "type": kind, "block_hashes": [h.hex() for h in changed]}
                )

    def restart(self) -> None:
        """A new process on the same address: new epoch, empty cache, sequence numbers from 0."""
        self.epoch, self.cached, self.events = uuid.uuid4().hex, OrderedDict(), []

    def prompt_hashes(self, ids: list[int], tenant: str | None) -> list[bytes]:
        return block_hashes(ids, self.behavior.block_size, FAKE_ROOT, encode_extra_keys(cache_salt=tenant))

    # --- handlers -------------------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _ready(self, request: web.Request) -> web.Response:
        return web.json_response({"phase": "ready"}, status=200 if self.behavior.ready else 503)

    async def _load(self, request: web.Request) -> web.Response:
        b = self.behavior
        await asyncio.sleep(b.load_delay_s)
        body = {
            "model": "fake-model",
            "epoch": self.epoch,
            "ready": b.ready,
            "phase": "ready" if b.ready else "loading",
            "waiting": self.waiting,
            "running": self.running,
            "swapped": 0,
            "queued_prefill_tokens": self.queued_prefill_tokens,
            "running_decode_tokens": self.running,
            "kv_blocks_total": 1000,
            "kv_blocks_free": 900,
            "kv_blocks_cached": len(self.cached),
            "kv_blocks_reserved": 0,
            "kv_usage": 0.1,
            "block_size": b.block_size,
            "max_num_seqs": 64,
            "max_num_batched_tokens": 2048,
            "prefill_tokens_per_second": 1000.0,
            "decode_step_seconds": 0.01,
        }
        body.update(b.load)
        return web.json_response(body)

    async def _events(self, request: web.Request) -> web.Response:
        since = int(request.query.get("since", "0"))
        gap = since > self.seq
        events = [] if gap else [e for e in self.events if e["seq"] > since]
        return web.json_response(
            {
                "epoch": self.epoch,
                "seq": self.seq,
                "gap": gap,
                "root": FAKE_ROOT.hex(),
                "block_size": self.behavior.block_size,
                "events": events,
            }
        )

    async def _snapshot(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "epoch": self.epoch,
                "seq": self.seq,
                "root": FAKE_ROOT.hex(),
                "block_size": self.behavior.block_size,
                "block_hashes": [h.hex() for h in self.cached],
            }
        )

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def _inference(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append((request.path, CIMultiDict(request.headers), body))
        self.inference_peers.append(
            request.transport.get_extra_info("peername") if request.transport else None
        )
        b = self.behavior
        if b.drop_unanswered:
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if b.inference_status != 200:
            return web.json_response(
                {"error": {"message": "fake failure", "code": b.inference_status}}, status=b.inference_status
            )
        tenant = resolve_tenant(request.headers, b.tenancy)
        try:
            if request.path.endswith("/chat/completions"):
                ids = chat_prompt_ids(self.tokenizer, body["messages"])
            else:
                ids = completion_prompt_ids(self.tokenizer, body["prompt"])
            hashes = self.prompt_hashes(ids, tenant)
        except BAD_INPUT as error:  # as the real engine: bad input is a 400, never a 500
            return web.json_response(FakeEngine.refusal(error), status=400)
        hit = 0
        while hit < (len(ids) - 1) // b.block_size and hashes[hit] in self.cached:
            hit += 1
        uncached = len(ids) - hit * b.block_size
        self.prompt_tokens += len(ids)
        self.cached_prompt_tokens += hit * b.block_size
        self.waiting += 1
        self.queued_prefill_tokens += uncached
        try:
            while b.hang:
                await asyncio.sleep(0.01)
            await asyncio.sleep(b.first_byte_s + uncached * b.prefill_s_per_token)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.waiting -= 1
            self.queued_prefill_tokens -= uncached
        if b.caching:
            self.store(hashes)
        self.running += 1
        try:
            return await self._answer(request, body, ids, hit * b.block_size)
        finally:
            self.running -= 1

    @staticmethod
    def refusal(error: Exception) -> dict[str, Any]:
        return {
            "error": {
                "message": f"fake engine: {type(error).__name__}",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_request",
            }
        }

    async def _answer(
        self, request: web.Request, body: dict, ids: list[int], cached: int
    ) -> web.StreamResponse:
        usage = {
            "prompt_tokens": len(ids),
            "completion_tokens": self.behavior.output_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        request_id = request.headers.get("x-request-id", "")
        if not body.get("stream"):
            self.first_bytes.add(request_id)
            return web.json_response(
                {
                    "object": "text_completion",
                    "choices": [{"text": "t0 t1 t2"}],
                    "usage": usage,
                    "served_by": self.port,
                },
                headers={"x-big": "a" * self.behavior.header_bytes} if self.behavior.header_bytes else None,
            )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(self.behavior.output_tokens):
            await response.write(f"data: {json.dumps({'choices': [{'text': f't{i}'}]})}\n\n".encode())
            self.first_bytes.add(request_id)
            await asyncio.sleep(self.behavior.token_delay_s)
        if self.behavior.tear_stream:
            await response.write(b'data: {"choices": [{"te')
            assert request.transport is not None
            request.transport.abort()
            return response
        await response.write(
            f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()
        )
        await response.write_eof()
        return response


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_profiler(tiny_model_dir: Path) -> RequestProfiler:
    return load_profiler(str(tiny_model_dir))


@pytest.fixture
async def fake_engines(tiny_tokenizer: Tokenizer) -> AsyncIterator[Callable[..., Any]]:
    """``await fake_engines(n, **behavior)`` → n started fake engines (stopped after the test)."""
    started: list[FakeEngine] = []

    async def make(count: int = 1, **behavior: Any) -> list[FakeEngine]:
        engines = [
            await FakeEngine(tiny_tokenizer, FakeEngineBehavior(**behavior)).start() for _ in range(count)
        ]
        started.extend(engines)
        return engines

    yield make
    for engine in started:
        await engine.stop()


@pytest.fixture
async def routers(tiny_profiler: RequestProfiler) -> AsyncIterator[Callable[..., Any]]:
    """``await routers(urls, policy=..., weights=..., ready=n)`` → a started in-process router whose fleet
    has ``ready`` routable replicas (default: all)."""
    started: list[RouterServer] = []

    async def make(
        urls: list[str],
        policy: str = "cache_aware",
        weights: str = "",
        ready: int | None = None,
        poll_interval_s: float = 0.02,
        request_timeout_s: float = 20.0,
        max_body_bytes: int = 1 << 20,
        body_read_timeout_s: float = 30.0,
        write_stall_timeout_s: float = 150.0,
        **tenancy: Any,
    ) -> RouterServer:
        config = RouterConfig(
            DiscoveryConfig(replicas=tuple(urls)),
            policy=policy,
            **tenancy,
            weights=ScoringWeights.parse(weights),
            poll=PollConfig(interval_s=poll_interval_s, timeout_s=0.5),
            upstream=UpstreamConfig(
                request_timeout_s=request_timeout_s,
                max_body_bytes=max_body_bytes,
                body_read_timeout_s=body_read_timeout_s,
                write_stall_timeout_s=write_stall_timeout_s,
            ),
        )
        server = await RouterServer(RouterApp(config, tiny_profiler)).start()
        started.append(server)
        await wait_for(lambda: len(server.router.fleet.routable()) == (len(urls) if ready is None else ready))
        return server

    yield make
    for server in started:
        await server.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


async def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


@pytest.fixture
def until() -> Callable[..., Any]:
    """``await until(lambda: ...)``: poll a condition (5 s limit) instead of sleeping a guessed time."""
    return wait_for
