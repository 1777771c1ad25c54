"""The ingress gate's body deadline works on every Python that ``requires-python`` admits: 3.10 has no
``asyncio.timeout()``, so the gate, called as ASGI middleware, must not need it (mypy found this with
``python_version = "3.10"``)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import orjson

from kvpilot.engine.server.config import ServerConfig
from kvpilot.engine.server.ingress import IngressGate

SCOPE = {
    "type": "http",
    "method": "POST",
    "path": "/v1/completions",
    "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
}


def _gate(app, rejected: list[str]) -> IngressGate:
    state = SimpleNamespace(
        config=ServerConfig(body_read_timeout_s=0.2),
        lifecycle=SimpleNamespace(snapshot=lambda: SimpleNamespace(ready=True)),
        metrics=SimpleNamespace(rejected=rejected.append),
        rate_limiter=None,
        inflight=0,
    )
    return IngressGate(app, state)


async def _never_sent(*_args) -> None:
    raise AssertionError("the app must not run")


async def test_a_stalled_body_gets_408_without_asyncio_timeout(monkeypatch):
    monkeypatch.delattr(asyncio, "timeout", raising=False)  # as on Python 3.10
    sent: list[dict] = []

    async def stalled() -> dict:
        await asyncio.Event().wait()
        return {}

    async def send(message: dict) -> None:
        sent.append(message)

    rejected: list[str] = []
    await asyncio.wait_for(_gate(_never_sent, rejected)(dict(SCOPE), stalled, send), 5)
    assert sent[0]["status"] == 408 and rejected == ["request_timeout"]
    assert orjson.loads(sent[1]["body"])["error"]["code"] == "request_timeout"


async def test_a_body_that_arrives_is_replayed_whole_without_asyncio_timeout(monkeypatch):
    monkeypatch.delattr(asyncio, "timeout", raising=False)
    parts = iter(
        [
            {"type": "http.request", "body": b'{"prompt":', "more_body": True},
            {"type": "http.request", "body": b' "x"}', "more_body": False},
        ]
    )

    async def receive() -> dict:
        return next(parts)

    seen: list[bytes] = []

    async def app(scope, receive, send) -> None:
        seen.append((await receive())["body"])

    rejected: list[str] = []
    await _gate(app, rejected)(dict(SCOPE), receive, lambda message: None)
    assert seen == [b'{"prompt": "x"}'] and rejected == []
