"""Talking to the endpoint before the load starts: readiness polling and model discovery.

Failures here are the user's to fix (wrong URL, server down, no model served), so they surface as
:class:`EndpointError` with a one-line message instead of a stack trace.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp


class EndpointError(Exception):
    """The endpoint cannot be used; the message says why in one line."""


@dataclass(frozen=True)
class ReadyResult:
    url: str
    time_to_ready_s: float  # from the first poll to the first HTTP 200
    polls: int


async def wait_until_ready(
    session: aiohttp.ClientSession, url: str, timeout_s: float, poll_interval_s: float = 0.2
) -> ReadyResult:
    """Poll ``url`` until it answers HTTP 200. Refused connections are expected while a server starts."""
    start = time.perf_counter()
    polls = 0
    last = "no answer yet"
    per_poll = aiohttp.ClientTimeout(total=max(poll_interval_s * 5, 1.0))
    while True:
        polls += 1
        try:
            async with session.get(url, timeout=per_poll) as response:
                if response.status == 200:
                    return ReadyResult(url=url, time_to_ready_s=time.perf_counter() - start, polls=polls)
                last = f"HTTP {response.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if time.perf_counter() - start > timeout_s:
            raise EndpointError(f"{url} was not ready after {timeout_s:g} s ({polls} polls, last: {last})")
        await asyncio.sleep(poll_interval_s)


@dataclass(frozen=True)
class ServedModel:
    id: str
    # the context the server reports for it (vLLM's and kvpilot's /v1/models carry max_model_len);
    # None when it reports none, and then the workload cannot be fitted to it
    max_model_len: int | None = None


def _max_model_len(entry: object) -> int | None:
    value = entry.get("max_model_len") if isinstance(entry, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


async def resolve_model(
    session: aiohttp.ClientSession, base_url: str, model: str | None, timeout_s: float
) -> ServedModel:
    """Check the endpoint answers at all, and return ``model`` or else the first id in ``/v1/models``,
    with the context length the listing gives for it."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            status = response.status
            listing = await response.json(content_type=None) if status == 200 else None
    except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
        reason = str(exc) or type(exc).__name__
        raise EndpointError(f"cannot reach the endpoint at {base_url}: {reason}") from None
    except (aiohttp.ClientError, ValueError) as exc:
        if model is not None:
            return ServedModel(model)
        raise EndpointError(f"{url} did not return a JSON model list ({exc}); pass --model") from None
    data = listing.get("data") if isinstance(listing, dict) else None
    entries = [entry for entry in data if isinstance(entry, dict)] if isinstance(data, list) else []
    if model is not None:
        named = [entry for entry in entries if entry.get("id") == model]
        return ServedModel(model, _max_model_len(named[0]) if named else None)
    if status != 200:
        raise EndpointError(f"{url} answered HTTP {status}; pass --model")
    if not data or not isinstance(data[0], dict) or not isinstance(data[0].get("id"), str):
        raise EndpointError(f"{url} lists no models; pass --model")
    return ServedModel(data[0]["id"], _max_model_len(data[0]))
