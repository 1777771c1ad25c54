"""``read_body`` under Python 3.10's timeout: there ``asyncio.wait_for`` raises ``asyncio.TimeoutError``, a
class of its own, not the builtin ``TimeoutError`` (one class from 3.11 on, where these tests run, so 3.10
is reproduced by giving ``asyncio`` such a class)."""

from __future__ import annotations

import asyncio
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
