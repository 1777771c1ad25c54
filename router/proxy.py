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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from multidict import CIMultiDict

from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.poller import ERROR, NOT_READY, TIMEOUT
from kvpilot.router.replica import Dispatch, Replica
from kvpilot.router.upstream import (
    UpstreamError,
    UpstreamKey,
    UpstreamPool,
    UpstreamResponse,
    request_head,
    upstream_key,
)

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
    """Records the routing overhead (arrival → upstream request written to its socket) once, then runs
    ``after`` (bookkeeping that need not delay the request)."""

    metrics: RouterMetrics
    arrival: float
    after: Callable[[], None] | None = None
    fired: bool = False

    def written(self) -> None:
        if not self.fired:
            self.fired = True
            self.metrics.overhead.observe(time.perf_counter() - self.arrival)
            self.settle()

    def settle(self) -> None:
        """Run ``after`` now if it has not run (the request failed before it was written)."""
        after, self.after = self.after, None
        if after is not None:
            after()


def forward_headers(headers: Any) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _HOP_BY_HOP)


def forward_raw_headers(raw_headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The client's header lines as it sent them, without hop-by-hop ones."""
    return [(name, value) for name, value in raw_headers if name.decode("latin-1").lower() not in _HOP_BY_HOP]


class Forwarder:
    def __init__(self, pool: UpstreamPool, eject: Callable[[Replica, str], None]) -> None:
        self._pool = pool
        self._eject = eject  # called when a replica fails mid-response (earlier failures raise instead)
        self._targets: dict[str, tuple[UpstreamKey, str]] = {}  # replica URL → (connection key, Host)

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

    def preconnect(self, replica: Replica) -> None:
        """Open a keep-alive connection to ``replica`` ahead of its first request."""
        self._pool.preconnect(self._target(replica.url)[0])

    def forget(self, url: str) -> None:
        """The replica at ``url`` left the fleet: drop what was kept for it (its idle connections included)."""
        target = self._targets.pop(url, None)
        if target is not None:
            self._pool.discard(target[0])

    def _target(self, url: str) -> tuple[UpstreamKey, str]:
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = (upstream_key(url), urlsplit(url).netloc)
        return target

    async def _forward(self, request: web.Request, body: bytes, replica: Replica, dispatch: Dispatch,
                       probe: SendProbe | None,
                       on_first_byte: Callable[[], None] | None) -> web.StreamResponse:
        key, host = self._target(replica.url)
        head = request_head(request.method, request.raw_path, host, len(body),
                            forward_raw_headers(request.raw_headers))
        try:
            upstream = await self._pool.request(key, head, body, probe.written if probe is not None else None)
        except TimeoutError:
            raise UpstreamFailure(TIMEOUT, f"{replica.url}: no answer in time") from None
        except UpstreamError as error:
            raise UpstreamFailure(ERROR, f"{replica.url}: {error}") from None
        async with upstream:
            if upstream.status in _RETRYABLE_STATUS:
                answer = await _read_quietly(upstream)
                raise UpstreamFailure(_RETRYABLE_STATUS[upstream.status], f"{replica.url}: HTTP {upstream.status}",
                                      (upstream.status, forward_headers(upstream.headers), answer))
            try:
                first = await upstream.read_chunk()
            except TimeoutError:
                raise UpstreamFailure(TIMEOUT, f"{replica.url}: no first byte in time") from None
            except UpstreamError as error:
                raise UpstreamFailure(ERROR, f"{replica.url}: dropped before the first byte: {error}") from None
            now = time.perf_counter()
            replica.first_byte(dispatch, now)
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason or None,
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

    async def _relay(self, request: web.Request, upstream: UpstreamResponse, response: web.StreamResponse,
                     replica: Replica) -> None:
        while True:
            try:
                chunk = await upstream.read_chunk()
            except (TimeoutError, UpstreamError) as error:
                log.warning("replica %s failed mid-response: %s", replica.url, error)
                self._eject(replica, TIMEOUT if isinstance(error, TimeoutError) else ERROR)
                await _break_response(request, response, f"upstream replica failed mid-response: {error}")
                return
            if not chunk:
                break
            await response.write(chunk)
        await response.write_eof()


async def _read_quietly(response: UpstreamResponse) -> bytes:
    try:
        return await response.read_all()
    except (TimeoutError, UpstreamError):
        return b""


async def _break_response(request: web.Request, response: web.StreamResponse, message: str) -> None:
    if response.content_type == "text/event-stream":
        event = {"error": {"message": message, "type": "bad_gateway", "param": None, "code": 502}}
        with contextlib.suppress(ConnectionResetError):
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
    if request.transport is not None:
        request.transport.close()  # no terminating chunk: the client sees a broken body, not a short one
