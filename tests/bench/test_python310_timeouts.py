"""The bench's endpoint checks under Python 3.10's timeouts, where aiohttp raises ``asyncio.TimeoutError``, a
class of its own rather than the builtin ``TimeoutError`` (one class from 3.11 on, where these tests run, so
3.10 is reproduced by giving ``asyncio`` such a class; as tests/router/test_python310_timeouts.py does)."""

from __future__ import annotations

import asyncio

import pytest

from kvpilot.bench.endpoint import EndpointError, resolve_model, wait_until_ready


class Python310TimeoutError(Exception):
    """asyncio.exceptions.TimeoutError as Python 3.10 defines it: no subclass of the builtin."""


class _TimingOutSession:
    def get(self, url: str, **kwargs: object) -> _TimingOutSession:
        return self

    async def __aenter__(self) -> None:
        raise Python310TimeoutError

    async def __aexit__(self, *exc: object) -> None:
        return None


async def test_an_endpoint_that_times_out_is_an_endpoint_error_on_python_3_10(monkeypatch):
    monkeypatch.setattr(asyncio, "TimeoutError", Python310TimeoutError)
    with pytest.raises(EndpointError, match="cannot reach the endpoint at http://x: Python310TimeoutError"):
        await resolve_model(_TimingOutSession(), "http://x", None, 1.0)  # type: ignore[arg-type]
    with pytest.raises(EndpointError, match=r"last: Python310TimeoutError\)"):
        await wait_until_ready(_TimingOutSession(), "http://x/ready", 0.0, 0.01)  # type: ignore[arg-type]
