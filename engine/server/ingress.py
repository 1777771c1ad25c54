"""The ingress gate (docs/architecture.md#admission, phase one): cheap checks on headers and size, before any
JSON parsing or tokenization, in this order:

1. ``/v1/*`` with ``--api-key``: ``Authorization: Bearer <key>`` must match one key (401);
2. inference POSTs only while ready (503 while loading, warming up or draining, with Retry-After);
3. the body may not exceed ``--max-body-bytes`` (413; a larger Content-Length is refused unread), as sent
   nor decoded from its Content-Encoding (``body_encoding``: gzip or deflate, else 415), nor take longer
   than ``--body-read-timeout`` to arrive (408); a client that disconnects before its body has
   arrived is counted (``kvpilot_requests_abandoned_total``) and gets nothing, never a 400 for the part it
   sent;
4. the tenant (``kvpilot.engine.tenancy.resolve_tenant``: with API keys, the key's tenant unless the
   router sidecar or ``--trust-tenant-header`` vouches for ``x-tenant``) must be well-formed (400) and have
   a token in its bucket (429 with Retry-After = seconds until it has one).

It also stamps the request's arrival (the boundary of every latency metric) and tenant into the ASGI
scope, and counts in-flight inference requests for the drain. The body it read is replayed to the app;
after that, ``receive`` is the server's own again, so disconnects still reach the handler.
"""

from __future__ import annotations

import asyncio
import hmac
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpilot.engine.server.body_encoding import body_decoder, too_large
from kvpilot.engine.server.errors import APIError, error_response
from kvpilot.engine.server.state import SCOPE_KEY, RequestContext, ServerState, not_ready
from kvpilot.engine.tenancy import TenantError, api_key_from_headers, resolve_tenant

INFERENCE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_TRACE_HEADERS = ("traceparent", "tracestate")


class _ClientLeft(Exception):
    """The client disconnected before its request body had arrived."""


class IngressGate:
    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        arrival, arrival_ns = time.monotonic(), time.time_ns()
        headers: dict[str, str] = {}
        for raw_name, raw_value in scope["headers"]:
            name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
            if name == "content-encoding" and name in headers:
                value = f"{headers[name]}, {value}"  # repeated lines are one list of codings (RFC 9110 §5.3)
            headers[name] = value
        inference = scope["method"] == "POST" and scope["path"] in INFERENCE_PATHS
        try:
            self._authenticate(headers)
            if inference:
                if not self.state.lifecycle.snapshot().ready:
                    raise not_ready(self.state)
                body = await self._read_body(headers, receive)
                tenant = self._admit_tenant(headers)
        except _ClientLeft:
            self.state.metrics.left_before_engine.inc()
            return
        except APIError as err:
            self.state.metrics.rejected(err.code)
            await error_response(err)(scope, receive, send)
            return
        if not inference:
            await self.app(scope, receive, send)
            return
        scope[SCOPE_KEY] = RequestContext(
            arrival, arrival_ns, tenant, {h: headers[h] for h in _TRACE_HEADERS if h in headers}
        )
        self.state.inflight += 1
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.state.inflight -= 1

    def _authenticate(self, headers: dict[str, str]) -> None:
        keys = self.state.config.api_keys
        if not keys:
            return
        given = api_key_from_headers(headers) or ""
        if not any(hmac.compare_digest(given.encode(), key.encode()) for key in keys):
            raise APIError(
                401, "missing or invalid API key (send 'Authorization: Bearer <key>')", code="invalid_api_key"
            )

    async def _read_body(self, headers: dict[str, str], receive: Receive) -> bytes:
        timeout = self.state.config.body_read_timeout_s
        try:  # wait_for, not asyncio.timeout(): that is Python 3.11+, and kvpilot supports 3.10
            return await asyncio.wait_for(self._read_body_unbounded(headers, receive), timeout)
        except asyncio.TimeoutError:  # the builtin TimeoutError only from 3.11 on
            raise APIError(
                408,
                f"the request body did not arrive within {timeout:g} s",
                code="request_timeout",
                closes=True,  # close rather than wait for (or read and drop) the rest of the body
            ) from None

    async def _read_body_unbounded(self, headers: dict[str, str], receive: Receive) -> bytes:
        limit = self.state.config.max_body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large(limit)
        decoder = body_decoder(headers.get("content-encoding"), limit)
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientLeft()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            parts.append(chunk if decoder is None else decoder.feed(chunk))
            if not message.get("more_body", False):
                break
        if decoder is not None:
            decoder.finish()
        return b"".join(parts)

    def _admit_tenant(self, headers: dict[str, str]) -> str | None:
        try:
            tenant = resolve_tenant(headers, self.state.config.tenant_policy)
        except TenantError as err:
            raise APIError(400, str(err), code="invalid_tenant", param="x-tenant") from None
        limiter = self.state.rate_limiter
        if limiter is not None:
            wait = limiter.acquire(tenant)
            if wait > 0:
                raise APIError(
                    429,
                    f"tenant over its rate limit ({limiter.rate:g} requests/s, burst "
                    f"{limiter.burst:g}); retry in {wait:.2f} s",
                    code="rate_limited",
                    retry_after=limiter.retry_after(wait),
                )
        return tenant


def _replay(body: bytes, receive: Receive) -> Receive:
    replayed = False

    async def replaying_receive() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replaying_receive
