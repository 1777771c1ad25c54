"""Forwards one client request to one replica and streams the answer back, byte for byte.

Nothing reaches the client until the upstream's first body byte has arrived, so every failure up to that
point (connect error, timeout, HTTP 502/503/504, a connection dropped before the first byte) can be retried
on another replica without the client noticing. After the first byte the client gets the error, never a
silently truncated answer that looks complete: an SSE stream ends as the engine ends one that fails, with a
``data: {"error": ...}`` event and ``data: [DONE]`` (an event the replica left half-written is dropped, so
the error starts on an event boundary; ``sse_events`` holds only so much of one, and a stream that fails
inside a longer one ends broken); any other body ends with a broken connection.

Messages to clients, and the ``x-kvpilot-replica`` header, name a replica by its pod where discovery knows
it (EndpointSlices), never by its address; a replica configured by URL (``--replicas``) is named by that URL.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from kvpilot.engine.tenancy import ROUTER_TOKEN_HEADER
from kvpilot.router.errors import end_broken, error_body, error_response
from kvpilot.router.poller import ERROR, NOT_READY, TIMEOUT
from kvpilot.router.replica import Dispatch, Replica
from kvpilot.router.sse_events import EventSplitter
from kvpilot.router.upstream import UpstreamClient, UpstreamError

log = logging.getLogger(__name__)
REPLICA_HEADER = "x-kvpilot-replica"
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
# Content-Encodings aiohttp's request parser decodes (aiohttp.http_parser.HttpParser.parse_headers): the
# router forwards such a body decoded, so the header no longer describes it.
_DECODED_ENCODINGS = frozenset({"gzip", "deflate", "br", "zstd"})
_RETRYABLE_STATUS = {502: ERROR, 503: NOT_READY, 504: TIMEOUT}


class UpstreamFailure(Exception):
    """The replica failed before the client got any byte: eject it and retry elsewhere. ``str()`` is for the
    log (it holds the replica's URL); :meth:`client_message` is for the client."""

    def __init__(
        self,
        reason: str,
        detail: str,
        problem: str,
        response: tuple[int, CIMultiDict[str], bytes] | None = None,
    ):
        super().__init__(detail)
        self.reason = reason
        self.problem = problem  # what went wrong, without addresses
        self.response = response  # what the replica answered, if it answered (502/503/504)
        self.replica_url: str | None = None
        self.replica_id = ""  # the x-kvpilot-replica value of the replica that failed
        self.replica_name = describe(None)

    def client_message(self) -> str:
        return f"{self.replica_name} failed before answering: {self.problem}"

    def client_response(self) -> web.Response:
        """What the client gets when no replica answered: the last replica's own 502/503/504 as it said it,
        else a 502 naming the failure."""
        replica = {REPLICA_HEADER: self.replica_id}
        if self.response is None:
            return error_response(502, self.client_message(), "upstream_failed", headers=replica)
        status, headers, body = self.response
        response = web.Response(status=status, body=body, headers=headers)
        response.headers.update(replica)
        return response


def replica_id(replica: Replica) -> str:
    """The ``x-kvpilot-replica`` value: the pod's name where discovery knows it, else the configured URL."""
    return replica.pod or replica.url


def describe(replica: Replica | None) -> str:
    """A replica as clients may see it: its pod's name if known, never its address."""
    pod = replica.pod if replica is not None else None
    return f"engine replica {pod}" if pod else "an upstream replica"


def forward_headers(headers: Any, vouch: str | None = None, decoded: bool = False) -> CIMultiDict[str]:
    """Headers to pass across the proxy: without hop-by-hop ones and without any router token the other side
    sent; ``vouch`` adds the deployment's own (the router names the tenant: ``--trust-tenant-header``).
    ``decoded``: the body goes on as aiohttp decoded it, so a Content-Encoding it undid is dropped
    (Content-Length, hop-by-hop, is the sent body's)."""
    forwarded = CIMultiDict(
        (k, v)
        for k, v in headers.items()
        if (lower := k.lower()) not in _HOP_BY_HOP
        and lower != ROUTER_TOKEN_HEADER
        and not (decoded and lower == "content-encoding" and v.isascii() and v.lower() in _DECODED_ENCODINGS)
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
        try:
            async with self._client.request(
                replica.url, request.method, request.raw_path, headers, body, on_written
            ) as upstream:
                return await self._answer(request, upstream, replica, dispatch, on_first_byte)
        except TimeoutError:
            raise UpstreamFailure(TIMEOUT, f"{replica.url}: no answer in time", "no answer in time") from None
        except UpstreamError as error:
            raise UpstreamFailure(ERROR, f"{replica.url}: {error!r}", "its connection failed") from None

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
        except TimeoutError:
            raise UpstreamFailure(
                TIMEOUT, f"{replica.url}: no first byte in time", "no first byte in time"
            ) from None
        except UpstreamError as error:
            raise UpstreamFailure(
                ERROR,
                f"{replica.url}: dropped before the first byte: {error!r}",
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
            except (TimeoutError, UpstreamError) as error:
                log.warning("replica %s failed mid-response: %r", replica.url, error)
                timed_out = isinstance(error, TimeoutError)
                self._eject(replica, TIMEOUT if timed_out else ERROR)
                problem = "it did not finish in time" if timed_out else "its connection broke"
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
    except (TimeoutError, UpstreamError):
        return b""
