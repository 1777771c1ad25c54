"""Forwards one client request to one replica and streams the answer back, byte for byte.

Nothing reaches the client until the upstream's first body byte has arrived, so every failure up to that
point (connect error, timeout, HTTP 502/503/504, a connection dropped before the first byte) can be retried
on another replica without the client noticing. After the first byte the client gets the error: an SSE
stream ends with an error event and a broken connection, any other body with a broken connection, never a
silently truncated answer that looks complete.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.poller import ERROR, NOT_READY, TIMEOUT
from kvpilot.router.replica import Dispatch, Replica

log = logging.getLogger(__name__)
REPLICA_HEADER = "x-kvpilot-replica"
# Per-connection headers and ones aiohttp writes itself: never copied across the proxy.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                         "trailer", "transfer-encoding", "upgrade", "host", "content-length", "date", "server"})
_RETRYABLE_STATUS = {502: ERROR, 503: NOT_READY, 504: TIMEOUT}


class UpstreamFailure(Exception):
    """The replica failed before the client got any byte: eject it and retry elsewhere."""

    def __init__(self, reason: str, detail: str, response: tuple[int, CIMultiDict[str], bytes] | None = None):
        super().__init__(detail)
        self.reason = reason
        self.response = response  # what the replica answered, if it answered (502/503/504)
        self.replica_url: str | None = None


@dataclass
class SendProbe:
    """Rides aiohttp's tracing into the moment the upstream request is written to the socket (aiohttp
    coalesces headers with the body, so that is the first body chunk) to record the routing overhead."""

    metrics: RouterMetrics
    arrival: float
    fired: bool = False


async def on_request_chunk_sent(session: Any, trace_context: Any, params: Any) -> None:
    probe = trace_context.trace_request_ctx
    if isinstance(probe, SendProbe) and not probe.fired:
        probe.fired = True
        probe.metrics.overhead.observe(time.perf_counter() - probe.arrival)


def send_trace_config() -> aiohttp.TraceConfig:
    config = aiohttp.TraceConfig()
    config.on_request_chunk_sent.append(on_request_chunk_sent)
    return config


def forward_headers(headers: Any) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _HOP_BY_HOP)


class Forwarder:
    def __init__(self, session: aiohttp.ClientSession, eject: Callable[[Replica, str], None]) -> None:
        self._session = session
        self._eject = eject  # called when a replica fails mid-response (earlier failures raise instead)

    async def forward(self, request: web.Request, body: bytes, replica: Replica, dispatch: Dispatch,
                      probe: SendProbe | None,
                      on_first_byte: Callable[[], None] | None = None) -> web.StreamResponse:
        """Send ``request`` to ``replica`` and stream its answer; raises :class:`UpstreamFailure` before
        the first byte. ``on_first_byte()`` runs once that byte has been relayed."""
        try:
            return await self._forward(request, body, replica, dispatch, probe, on_first_byte)
        except UpstreamFailure as failure:
            failure.replica_url = replica.url
            raise

    async def _forward(self, request: web.Request, body: bytes, replica: Replica, dispatch: Dispatch,
                       probe: SendProbe | None,
                       on_first_byte: Callable[[], None] | None) -> web.StreamResponse:
        url = replica.url + str(request.rel_url)
        try:
            upstream = await self._session.request(request.method, url, data=body,
                                                   headers=forward_headers(request.headers),
                                                   trace_request_ctx=probe)
        except TimeoutError:
            raise UpstreamFailure(TIMEOUT, f"{replica.url}: no answer in time") from None
        except aiohttp.ClientError as error:
            raise UpstreamFailure(ERROR, f"{replica.url}: {type(error).__name__}: {error}") from None
        async with upstream:
            if upstream.status in _RETRYABLE_STATUS:
                answer = await _read_quietly(upstream)
                raise UpstreamFailure(_RETRYABLE_STATUS[upstream.status], f"{replica.url}: HTTP {upstream.status}",
                                      (upstream.status, forward_headers(upstream.headers), answer))
            try:
                first = await upstream.content.readany()
            except TimeoutError:
                raise UpstreamFailure(TIMEOUT, f"{replica.url}: no first byte in time") from None
            except aiohttp.ClientError as error:
                raise UpstreamFailure(ERROR, f"{replica.url}: dropped before the first byte: {error}") from None
            now = time.perf_counter()
            replica.first_byte(dispatch, now)
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                          headers=forward_headers(upstream.headers))
            response.headers[REPLICA_HEADER] = replica.url
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            try:
                await response.prepare(request)
                if first:
                    await response.write(first)
                if on_first_byte is not None:
                    on_first_byte()
                await self._relay(request, upstream, response, replica)
            except ConnectionResetError:
                pass  # the client left; leaving the context closes the upstream, which aborts it there
            return response

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse, response: web.StreamResponse,
                     replica: Replica) -> None:
        while True:
            try:
                chunk = await upstream.content.readany()
            except (TimeoutError, aiohttp.ClientError) as error:
                log.warning("replica %s failed mid-response: %s", replica.url, error)
                self._eject(replica, TIMEOUT if isinstance(error, TimeoutError) else ERROR)
                await _break_response(request, response, f"upstream replica failed mid-response: {error}")
                return
            if not chunk:
                break
            await response.write(chunk)
        await response.write_eof()


async def _read_quietly(response: aiohttp.ClientResponse) -> bytes:
    try:
        return await response.read()
    except (TimeoutError, aiohttp.ClientError):
        return b""


async def _break_response(request: web.Request, response: web.StreamResponse, message: str) -> None:
    if response.content_type == "text/event-stream":
        event = {"error": {"message": message, "type": "bad_gateway", "param": None, "code": 502}}
        with contextlib.suppress(ConnectionResetError):
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
    if request.transport is not None:
        request.transport.close()  # no terminating chunk: the client sees a broken body, not a short one
