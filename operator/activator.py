"""``kvpilot operator activator``: what answers an InferenceService scaled to zero
(docs/architecture.md#scale-to-zero).

While no replica is Ready, the client Service ``<name>`` selects this small always-on Deployment instead
of the engine pods. A request that finds no Ready replica is *held* in a bounded queue
(``--queue-size``; past it, or past ``--hold-timeout``, it gets an OpenAI-style 503 with ``Retry-After``);
the operator's autoscaler reads ``kvpilot_activator_held_requests`` and ``_held_total`` from this
process's ``/metrics`` and scales from zero at once; when a replica's router is Ready (the EndpointSlices
of ``<name>-engines``, polled with the routers' ServiceAccount), every held request is forwarded to it and
its answer streamed back. Held requests' time to first byte is ``kvpilot_activator_cold_start_ttft_seconds``,
reported apart from the engines' steady-state TTFT. A replica whose router refuses the connection (its pod
is going away while the lookup still lists it) never saw the request: the next replica gets it, or the
request is held for one, within the same hold timeout. A replica that fails after taking the request may
have started it, so it is not retried: the client gets an OpenAI-style 502 (``upstream_failed``), or, once
the answer has begun, an SSE stream's error event and ``[DONE]`` (any other body ends with a broken
connection), never a 500 or a body that looks complete. Once the Service selects the replicas again, no new
request comes here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import aiohttp.web
from prometheus_client import generate_latest

from kvpilot.operator.activator_metrics import ActivatorMetrics
from kvpilot.router.config import UpstreamConfig
from kvpilot.router.connections import RouterRunner
from kvpilot.router.errors import close_after, end_broken, error_body, error_response
from kvpilot.router.json_body import BodyError, read_body
from kvpilot.router.proxy import forward_headers
from kvpilot.router.upstream import error_text

log = logging.getLogger(__name__)
Upstreams = Callable[[], Awaitable[list[str]]]  # the Ready routers' base URLs


@dataclass(frozen=True)
class ActivatorConfig:
    namespace: str
    name: str  # the InferenceService
    queue_size: int = 256  # held requests at most; more get 503 queue_full
    hold_timeout_seconds: float = 300.0  # a held request waits this long for a replica, then 503
    poll_seconds: float = 0.5  # how often the Ready replicas are looked up
    retry_after_seconds: int = 10
    # a request body is read as a replica's router reads it (the same defaults): a request that a warm
    # service takes must not be refused cold
    max_body_bytes: int = UpstreamConfig.max_body_bytes
    body_read_timeout_seconds: float = UpstreamConfig.body_read_timeout_s


def _unavailable(message: str, code: str, retry_after: int) -> aiohttp.web.Response:
    return aiohttp.web.json_response(
        {"error": {"message": message, "type": "server_error", "param": None, "code": code}},
        status=503,
        headers={"Retry-After": str(retry_after)},
    )


class Activator:
    def __init__(self, config: ActivatorConfig, upstreams: Upstreams) -> None:
        self.config, self._upstreams = config, upstreams
        self.metrics = ActivatorMetrics()
        self._ready: list[str] = []
        self._available = asyncio.Event()
        self._held = 0
        self._turn = 0
        self._session: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task[None] | None = None

    async def _poll(self) -> None:
        while True:
            try:
                self._ready = await self._upstreams()
            except Exception as error:  # a failed lookup keeps the last answer; the next poll retries
                log.warning("looking up the ready replicas failed: %s", error)
            if self._ready:
                self._available.set()
            else:
                self._available.clear()
            await asyncio.sleep(self.config.poll_seconds)

    def _replica(self) -> str | None:
        """The next Ready replica's router, round robin; None while there is none."""
        if not self._ready:  # set and emptied together with _available
            return None
        self._turn += 1
        return self._ready[self._turn % len(self._ready)]

    def _refused(self, upstream: str) -> None:
        """``upstream`` refused a connection (its pod is going away, or the lookup is stale): skip it until
        the next lookup lists it again."""
        self._ready = [u for u in self._ready if u != upstream]
        if not self._ready:
            self._available.clear()

    async def _wait_for_replica(self, deadline: float, first_hold: bool) -> aiohttp.web.Response | None:
        """None once a replica is Ready; a 503 past the queue's size or the hold deadline."""
        config = self.config
        if first_hold and self._held >= config.queue_size:
            self.metrics.rejected.labels("queue_full").inc()
            return _unavailable(
                f"{config.name} is scaling from zero and {config.queue_size} requests already wait",
                "queue_full",
                config.retry_after_seconds,
            )
        self._held += 1
        self.metrics.held.set(self._held)
        if first_hold:
            self.metrics.held_total.inc()
        try:
            await asyncio.wait_for(self._available.wait(), max(deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            self.metrics.rejected.labels("hold_timeout").inc()
            return _unavailable(
                f"{config.name} has no ready replica after {config.hold_timeout_seconds:g} s",
                "hold_timeout",
                config.retry_after_seconds,
            )
        finally:
            self._held -= 1
            self.metrics.held.set(self._held)
        return None

    async def _connect(
        self, request: aiohttp.web.Request, body: bytes, deadline: float
    ) -> tuple[aiohttp.ClientResponse | aiohttp.web.Response, bool]:
        """The answer of the first replica that takes the request's connection, holding the request while
        there is none, or the 503 once the hold deadline passes; and whether it was held (its first byte
        is then a cold start). A replica that refuses the connection never saw the request, so the next
        one (or the next lookup's) gets it."""
        assert self._session is not None
        # as the router's proxy forwards: the body as read_body decoded it, without the encoding it undid
        headers = forward_headers(request.headers, decoded=True)
        held = False
        while True:
            upstream = self._replica()
            if upstream is None:
                refusal = await self._wait_for_replica(deadline, first_hold=not held)
                if refusal is not None:
                    return refusal, held
                held = True
                continue
            try:
                answer = await self._session.request(
                    request.method, f"{upstream}{request.rel_url}", data=body, headers=headers
                )
            except aiohttp.ClientConnectorError as error:
                log.warning("replica %s refused the connection (%s); trying the next one", upstream, error)
                self._refused(upstream)
                continue
            except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                # it may have taken the request before failing: another try could run it twice
                log.warning("replica %s failed before answering: %s", upstream, error_text(error))
                self.metrics.upstream_failures.inc()
                return error_response(
                    502, f"a replica of {self.config.name} failed before answering", "upstream_failed"
                ), held
            return answer, held

    async def handle(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        arrived = time.monotonic()
        self.metrics.requests.inc()
        try:
            body = await read_body(request, self.config.max_body_bytes, self.config.body_read_timeout_seconds)
        except BodyError as refused:
            refusal = error_response(refused.status, str(refused), refused.code, refused.headers)
            if refused.closes:
                await close_after(request, refusal)  # the rest of the body cannot be read
            return refusal
        answer, held = await self._connect(request, body, arrived + self.config.hold_timeout_seconds)
        if isinstance(answer, aiohttp.web.Response):
            return answer
        async with answer:
            response = aiohttp.web.StreamResponse(
                status=answer.status,
                headers=forward_headers(answer.headers),
            )
            await response.prepare(request)
            # an SSE stream can end with an error event, at an event boundary (the engine writes whole ones)
            events = response.content_type == "text/event-stream" and response.content_length is None
            first, whole = True, True
            try:
                async for chunk in answer.content.iter_any():
                    if first and held:
                        self.metrics.cold_start_ttft.observe(time.monotonic() - arrived)
                    first, whole = False, chunk.endswith(b"\n\n")
                    await response.write(chunk)
            except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                log.warning("a replica of %s failed mid-response: %s", self.config.name, error_text(error))
                self.metrics.upstream_failures.inc()
                message = f"a replica of {self.config.name} failed mid-response: its connection broke"
                await end_broken(
                    request, response, events and whole, error_body(502, message, "upstream_failed")
                )
                return response
            await response.write_eof()
            return response

    async def start(self, app: aiohttp.web.Application) -> None:
        self._session = aiohttp.ClientSession(
            # answers pass byte for byte, their Content-Encoding with them
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            auto_decompress=False,
        )
        self._poller = asyncio.create_task(self._poll())

    async def stop(self, app: aiohttp.web.Application) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._session is not None:
            await self._session.close()

    def runner(self) -> RouterRunner:
        """The activator's app on connections served as a replica's router serves them: JSON errors for
        unparsable requests, request heads and bodies within the body-read timeout, bodies left as sent for
        :func:`read_body` to decode, a disconnected client's held request cancelled (its place freed)."""
        return RouterRunner(
            self.app(),
            UpstreamConfig().client_limits,
            self.config.body_read_timeout_seconds,
            handler_cancellation=True,
            access_log=None,
            # on SIGTERM, streams forwarded from a woken replica get most of the pod's default 30 s grace
            shutdown_timeout=25.0,
        )

    def app(self) -> aiohttp.web.Application:
        app = aiohttp.web.Application(client_max_size=self.config.max_body_bytes)

        async def ok(_: aiohttp.web.Request) -> aiohttp.web.Response:
            return aiohttp.web.json_response({"status": "ok"})

        async def metrics(_: aiohttp.web.Request) -> aiohttp.web.Response:
            return aiohttp.web.Response(
                body=generate_latest(self.metrics.registry), content_type="text/plain"
            )

        app.router.add_get("/health", ok)
        app.router.add_get("/ready", ok)
        app.router.add_get("/metrics", metrics)
        app.router.add_route("*", "/v1/{tail:.*}", self.handle)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app


__all__ = ["Activator", "ActivatorConfig", "Upstreams"]
