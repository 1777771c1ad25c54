"""Forwards one client request to one replica and streams the answer back, byte for byte.

Nothing reaches the client until the upstream's first body byte has arrived, so every failure of the
replica up to that point (connect error or timeout, HTTP 502/503/504, a connection dropped before the first
byte) can be retried on another replica without the client noticing. A failure of the request alone ejects
nothing and runs nothing twice (docs/architecture.md#engine-and-router): past ``--request-timeout`` it is a
504, an answer head that does not parse a 502. After the first byte the client gets the error, never a
silently truncated answer that looks complete: an SSE stream ends as the engine ends one that fails, with a
``data: {"error": ...}`` event and ``data: [DONE]`` (an event the replica left half-written is dropped, so
the error starts on an event boundary; ``sse_events`` holds only so much of one, and a stream that fails
inside a longer one ends broken); any other body ends with a broken connection.

Messages to clients, and the ``x-kvpilot-replica`` header, name a replica by its pod where discovery knows
it (EndpointSlices), never by its address; a replica configured by URL (``--replicas``) is named by that URL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from kvpilot.engine.tenancy import ROUTER_TOKEN_HEADER
from kvpilot.router.errors import end_broken, error_body
from kvpilot.router.poller import ERROR, NOT_READY, TIMEOUT
from kvpilot.router.replica import Dispatch, Replica
from kvpilot.router.sse_events import EventSplitter
from kvpilot.router.upstream import UpstreamClient, UpstreamError, error_text
from kvpilot.router.upstream_failure import (
    REPLICA_HEADER,
    UpstreamFailure,
    describe,
    replica_id,
    request_timeout,
)

log = logging.getLogger(__name__)
# Per-connection headers and ones aiohttp writes itself: never copied across the proxy.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "date",
        "server",
    }
)
_RETRYABLE_STATUS = {502: ERROR, 503: NOT_READY, 504: TIMEOUT}


def forward_headers(headers: Any, vouch: str | None = None, decoded: bool = False) -> CIMultiDict[str]:
    """Headers to pass across the proxy: without hop-by-hop ones and without any router token the other side
    sent; ``vouch`` adds the deployment's own (the router names the tenant: ``--trust-tenant-header``).
    ``decoded``: the body goes on with its Content-Encoding undone (``json_body.read_body``), so that header
    no longer describes it (Content-Length, hop-by-hop, is the sent body's)."""
    forwarded = CIMultiDict(
        (k, v)
        for k, v in headers.items()
        if (lower := k.lower()) not in _HOP_BY_HOP
        and lower != ROUTER_TOKEN_HEADER
        and not (decoded and lower == "content-encoding")
    )
    if vouch is not None:
        forwarded[ROUTER_TOKEN_HEADER] = vouch
    return forwarded


class Forwarder:
    def __init__(
        self, client: UpstreamClient, eject: Callable[[Replica, str], None], vouch_token: str | None = None
    ) -> None:
        self._client = client
        self._vouch = vouch_token or None
        self._eject = eject  # called when a replica fails mid-response (earlier failures raise instead)

    async def forward(
        self,
        request: web.Request,
        body: bytes,
        replica: Replica,
        dispatch: Dispatch,
        on_written: Callable[[], None] | None = None,
        on_first_byte: Callable[[], None] | None = None,
    ) -> web.StreamResponse:
        """Send ``request`` to ``replica`` and stream its answer; raises :class:`UpstreamFailure` before
        the first byte. ``on_written()`` runs as the request goes out, ``on_first_byte()`` once that byte
        has been relayed."""
        try:
            return await self._forward(request, body, replica, dispatch, on_written, on_first_byte)
        except UpstreamFailure as failure:
            failure.replica_url, failure.replica_name = replica.url, describe(replica)
            failure.replica_id = replica_id(replica)
            raise

    def forget(self, url: str) -> None:
        """The replica at ``url`` left the fleet: its connections close once its requests have ended."""
        self._client.forget(url)

    async def _forward(
        self,
        request: web.Request,
        body: bytes,
        replica: Replica,
        dispatch: Dispatch,
        on_written: Callable[[], None] | None,
        on_first_byte: Callable[[], None] | None,
    ) -> web.StreamResponse:
        headers = forward_headers(request.headers, self._vouch, decoded=True)
        # the target's path and query only: an absolute-form target (``POST http://x/v1/...``) is routed by
        # its path, and its scheme and host are the client's, not the replica's
        path = request.rel_url.raw_path_qs
        try:
            async with self._client.request(
                replica.url, request.method, path, headers, body, on_written
            ) as upstream:
                return await self._answer(request, upstream, replica, dispatch, on_first_byte)
        except aiohttp.InvalidURL as error:  # the router's own doing: a 500 (errors.json_errors), no ejection
            raise RuntimeError(f"the router built an invalid upstream URL: {error}") from None
        except aiohttp.ConnectionTimeoutError:
            raise UpstreamFailure(
                TIMEOUT, f"{replica.url}: no connection in time", "it accepted no connection in time"
            ) from None
        except asyncio.TimeoutError:  # the builtin TimeoutError only from 3.11 on
            raise request_timeout(replica) from None
        except aiohttp.ClientResponseError as error:  # the answer's head could not be parsed
            raise UpstreamFailure(
                ERROR,
                f"{replica.url}: malformed answer: {error_text(error)}",
                "its answer was malformed",
                replica_fault=False,
            ) from None
        except UpstreamError as error:
            raise UpstreamFailure(
                ERROR, f"{replica.url}: {error_text(error)}", "its connection failed"
            ) from None

    async def _answer(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        replica: Replica,
        dispatch: Dispatch,
        on_first_byte: Callable[[], None] | None,
    ) -> web.StreamResponse:
        if upstream.status in _RETRYABLE_STATUS:
            answer = await _read_quietly(upstream)
            raise UpstreamFailure(
                _RETRYABLE_STATUS[upstream.status],
                f"{replica.url}: HTTP {upstream.status}",
                f"HTTP {upstream.status}",
                (upstream.status, forward_headers(upstream.headers), answer),
            )
        try:
            first = await upstream.content.readany()
        except asyncio.TimeoutError:  # the builtin TimeoutError only from 3.11 on
            raise request_timeout(replica) from None
        except UpstreamError as error:
            raise UpstreamFailure(
                ERROR,
                f"{replica.url}: dropped before the first byte: {error_text(error)}",
                "its connection dropped before the first byte",
            ) from None
        replica.first_byte(dispatch, time.perf_counter(), upstream.status)
        response = web.StreamResponse(
            status=upstream.status, reason=upstream.reason or None, headers=forward_headers(upstream.headers)
        )
        response.headers[REPLICA_HEADER] = replica_id(replica)
        if upstream.content_length is not None:
            response.content_length = upstream.content_length
        try:
            await response.prepare(request)
            await self._relay(request, upstream, response, replica, first, on_first_byte)
        except ConnectionResetError:
            pass  # the client left; leaving the context closes the upstream, which aborts it there
        return response

    async def _relay(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        response: web.StreamResponse,
        replica: Replica,
        chunk: bytes,
        on_first_byte: Callable[[], None] | None,
    ) -> None:
        # an SSE stream that can take an error event after a failure (one of known length cannot)
        events = response.content_type == "text/event-stream" and response.content_length is None
        # an SSE event not complete yet is relayed with its end, dropped if the replica dies first
        splitter = EventSplitter() if events else None
        while True:
            if splitter is not None:
                chunk = splitter.feed(chunk)
            if chunk:
                await response.write(chunk)
                # aiohttp waits for a paused transport only every 64 KiB written: wait at once, so the
                # client connection holds no more than its share of the stream budget
                await request.writer.drain()
            if on_first_byte is not None:
                on_first_byte()
                on_first_byte = None
            try:
                chunk = await upstream.content.readany()
            except (asyncio.TimeoutError, UpstreamError) as error:
                timed_out = isinstance(error, asyncio.TimeoutError)
                if timed_out:  # the request ran long: no fault of the replica's
                    log.info("request to replica %s ran past the request timeout", replica.url)
                else:
                    log.warning("replica %s failed mid-response: %s", replica.url, error_text(error))
                    self._eject(replica, ERROR)
                problem = "it ran past the router's request timeout" if timed_out else "its connection broke"
                await end_broken(
                    request,
                    response,
                    splitter is not None and not splitter.torn,  # an error event, unless after half an event
                    error_body(
                        504 if timed_out else 502,
                        f"{describe(replica)} failed mid-response: {problem}",
                        "upstream_timeout" if timed_out else "upstream_failed",
                    ),
                )
                return
            if not chunk:
                break
        if splitter is not None and (rest := splitter.rest()):
            await response.write(rest)  # the replica ended its body there: pass on what it sent
        await response.write_eof()


async def _read_quietly(response: aiohttp.ClientResponse) -> bytes:
    try:
        return await response.read()
    except (asyncio.TimeoutError, UpstreamError):
        return b""
