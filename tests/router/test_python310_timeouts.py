"""``read_body`` and the replica polls under Python 3.10's timeouts: there ``asyncio.wait_for`` and aiohttp
raise ``asyncio.TimeoutError``, a class of its own, not the builtin ``TimeoutError`` (one class from 3.11 on,
where these tests run, so 3.10 is reproduced by giving ``asyncio`` such a class)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from multidict import CIMultiDict

from kvpilot.router import json_body
from kvpilot.router.json_body import BodyError, read_body


class Python310TimeoutError(Exception):
    """asyncio.exceptions.TimeoutError as Python 3.10 defines it: no subclass of the builtin."""


class _SlowRequest:
    headers: CIMultiDict[str] = CIMultiDict()
    content_length = None

    async def read(self) -> bytes:
        raise AssertionError("wait_for is replaced: the body is never read")


async def test_a_body_past_the_read_timeout_is_408_on_python_3_10(monkeypatch):
    async def timed_out(awaitable: Any, timeout: float) -> bytes:
        awaitable.close()
        raise Python310TimeoutError

    monkeypatch.setattr(asyncio, "TimeoutError", Python310TimeoutError)
    monkeypatch.setattr(json_body.asyncio, "wait_for", timed_out)
    with pytest.raises(BodyError) as refused:
        await read_body(_SlowRequest(), 1 << 20, 0.5)  # type: ignore[arg-type]
    assert (refused.value.status, refused.value.code, refused.value.closes) == (408, "request_timeout", True)
    assert str(refused.value) == "the request body did not arrive within 0.5 s"


class _TimingOutSession:
    """A session whose every GET times out as aiohttp's total timeout does on Python 3.10."""

    def get(self, url: str) -> _TimingOutSession:
        return self

    async def __aenter__(self) -> None:
        raise Python310TimeoutError

    async def __aexit__(self, *exc: object) -> None:
        return None


class _Ejections:
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def on_eject(self, replica: Any, reason: str, was_routable: bool) -> None:
        self.reasons.append(reason)

    def on_load(self, replica: Any, was_routable: bool) -> None:
        raise AssertionError("no load arrives")

    def on_resync(self, replica: Any) -> None:
        raise AssertionError("no snapshot arrives")


async def test_a_poll_that_times_out_ejects_the_replica_on_python_3_10(monkeypatch):
    # Before, the timeout escaped both polls: poll_once raised, and the replica's polling task ended for good
    from kvpilot.router.poller import TIMEOUT, ReplicaPoller
    from kvpilot.router.replica import Replica

    monkeypatch.setattr(asyncio, "TimeoutError", Python310TimeoutError)
    listener = _Ejections()
    poller = ReplicaPoller(Replica("http://replica:8000"), _TimingOutSession(), 1.0, listener)  # type: ignore[arg-type]
    await poller.poll_once()
    assert listener.reasons == [TIMEOUT]


async def test_a_request_past_the_request_timeout_is_504_on_python_3_10(
    fake_engines, routers, http, monkeypatch
):
    # aiohttp's total timeout raises asyncio.TimeoutError: on 3.10 it passed the proxy's handlers, a 500
    monkeypatch.setattr(asyncio, "TimeoutError", Python310TimeoutError)
    engine = await fake_engines(1)
    engine[0].behavior.hang = True
    router = await routers([engine[0].url], request_timeout_s=0.3)
    async with http.post(router.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}) as response:
        assert response.status == 504
        assert json.loads(await response.read())["error"]["code"] == "upstream_timeout"
    assert len(router.router.fleet.routable()) == 1  # a request that ran long ejects nobody
