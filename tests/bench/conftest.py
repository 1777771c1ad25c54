"""A small fake OpenAI-compatible SSE server for the bench tests, run in a background thread.

Behaviour is set per server: delay per output token, a stall before the first request's first token,
one-at-a-time service, and request numbers (1-based, counted over all completion requests) that fail with
HTTP 500, drop the connection mid-stream, or hang. Every output token is its own SSE event; chat streams
open with a role-only event that carries no text, as OpenAI's and vLLM's do. Its tokenizer costs
``bos_tokens`` plus ``tokens_per_word`` a word; with ``max_model_len`` set, /v1/models reports it and a
request whose prompt + max_tokens exceeds it is refused with vLLM's HTTP 400. An unstreamed request gets
one JSON answer.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass

import pytest
from aiohttp import web


@dataclass
class FakeServerBehavior:
    token_delay_s: float = 0.002  # before each output token
    stall_first_request_s: float = 0.0  # extra wait before the very first request's first token
    serialize: bool = False  # serve one request at a time (a server with a single slot)
    fail_every: int = 0  # every k-th request answers HTTP 500 (0: never)
    break_every: int = 0  # every k-th request drops the connection after two tokens
    hang_every: int = 0  # every k-th request waits hang_s before its first token
    hang_s: float = 5.0
    ready_after_s: float = 0.0  # /ready answers 503 until this long after the server started
    model: str = "fake-model"
    max_model_len: int | None = None  # reported by /v1/models and enforced (None: neither)
    tokens_per_word: int = 1
    bos_tokens: int = 0  # tokens every prompt costs besides its words
    report_usage: bool = True  # False: no usage in unstreamed answers (streams follow include_usage)


class FakeOpenAIServer:
    def __init__(self, behavior: FakeServerBehavior):
        self.behavior = behavior
        self.requests: list[tuple[dict[str, str], dict]] = []  # (headers, body) per completion request
        self.ready_polls: list[int] = []  # HTTP status answered to each /ready poll
        self._count = 0
        self._lock = asyncio.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._started = 0.0
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeOpenAIServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start_site(), self._loop).result(timeout=10)
        return self

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _start_site(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/ready", self._ready)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        # handler_cancellation: a hanging handler ends when the client gives up, so shutdown is quick.
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self._started = time.perf_counter()

    async def _models(self, request: web.Request) -> web.Response:
        card: dict = {"id": self.behavior.model, "object": "model"}
        if self.behavior.max_model_len is not None:
            card["max_model_len"] = self.behavior.max_model_len
        return web.json_response({"object": "list", "data": [card]})

    def prompt_tokens(self, body: dict) -> int:
        prompt = body.get("prompt") or " ".join(m["content"] for m in body["messages"])
        return self.behavior.bos_tokens + self.behavior.tokens_per_word * len(prompt.split())

    async def _ready(self, request: web.Request) -> web.Response:
        ready = time.perf_counter() - self._started >= self.behavior.ready_after_s
        self.ready_polls.append(200 if ready else 503)
        return web.json_response({"phase": "ready" if ready else "loading"}, status=200 if ready else 503)

    def _is_every(self, number: int, every: int) -> bool:
        return every > 0 and number % every == 0

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self._count += 1
        number = self._count
        self.requests.append((dict(request.headers), body))
        b = self.behavior
        if self._is_every(number, b.fail_every):
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        prompt_tokens, max_tokens = self.prompt_tokens(body), int(body["max_tokens"])
        if b.max_model_len is not None and prompt_tokens + max_tokens > b.max_model_len:
            message = (
                f"This model's maximum context length is {b.max_model_len} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
                "completion)."
            )
            error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
            return web.json_response({"error": error}, status=400)
        if not body.get("stream"):
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens}
            answer = {"choices": [{"index": 0, "text": " tok0" * max_tokens, "finish_reason": "length"}]}
            return web.json_response(answer | ({"usage": usage} if b.report_usage else {}))
        if b.serialize:
            async with self._lock:
                return await self._stream(request, body, number)
        return await self._stream(request, body, number)

    async def _stream(self, request: web.Request, body: dict, number: int) -> web.StreamResponse:
        b = self.behavior
        chat = request.path.endswith("/chat/completions")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if chat:
            await _send(response, {"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        if number == 1 and b.stall_first_request_s:
            await asyncio.sleep(b.stall_first_request_s)
        if self._is_every(number, b.hang_every):
            await asyncio.sleep(b.hang_s)
        max_tokens = int(body["max_tokens"])
        for i in range(max_tokens):
            await asyncio.sleep(b.token_delay_s)
            text = f" tok{i}"
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            choice["finish_reason"] = "length" if i == max_tokens - 1 else None
            await _send(response, {"choices": [choice]})
            if i == 1 and self._is_every(number, b.break_every):
                request.transport.close()  # drop the connection mid-stream
                return response
        if (body.get("stream_options") or {}).get("include_usage"):
            prompt_tokens = self.prompt_tokens(body)
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": max_tokens,
                "total_tokens": prompt_tokens + max_tokens,
            }
            await _send(response, {"choices": [], "usage": usage})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _send(response: web.StreamResponse, event: dict) -> None:
    await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")


@pytest.fixture
def fake_server():
    """Call with FakeServerBehavior fields to start a server; all are stopped after the test."""
    servers: list[FakeOpenAIServer] = []

    def start(**behavior) -> FakeOpenAIServer:
        server = FakeOpenAIServer(FakeServerBehavior(**behavior)).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
