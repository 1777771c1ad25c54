"""The router's HTTP surface (aiohttp): the proxied OpenAI endpoints, its own ``/health``, ``/ready``,
``/metrics``, and the start/stop of discovery, pollers and client connections (aiohttp's, ``upstream``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Callable

import aiohttp
from aiohttp import web

from kvpilot.engine.tenancy import TenantError, resolve_tenant
from kvpilot.router.config import RouterConfig
from kvpilot.router.endpointslices import Endpoint, EndpointSliceWatcher, SliceApi
from kvpilot.router.errors import close_after, error_response, json_errors
from kvpilot.router.fleet import Fleet
from kvpilot.router.json_body import BodyError, read_json_object
from kvpilot.router.metrics import CONTENT_TYPE, RouterMetrics
from kvpilot.router.picker import ReplicaPicker
from kvpilot.router.proxy import Forwarder
from kvpilot.router.replica import Dispatch, Replica
from kvpilot.router.request_profile import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    PromptError,
    RequestProfile,
    RequestProfiler,
)
from kvpilot.router.scoring import Decision
from kvpilot.router.upstream import UpstreamClient
from kvpilot.router.upstream_failure import UpstreamFailure

log = logging.getLogger(__name__)
MODELS = "/v1/models"
ATTEMPTS = 2  # the first try and one retry elsewhere
#: picks one of the candidate replicas; the decision is None for requests that are not routing decisions
Choose = Callable[[list[Replica]], tuple[Replica, Decision | None]]


class RouterApp:
    def __init__(
        self,
        config: RouterConfig,
        profiler: RequestProfiler | None,
        slice_api: Callable[[], SliceApi] | None = None,
    ) -> None:
        """``profiler`` derives prompts (None: route without locality, as the baselines do); ``slice_api``
        makes the EndpointSlice client when ``config.discovery`` names a Service."""
        if config.discovery.endpointslice_service and slice_api is None:
            raise ValueError("EndpointSlice discovery needs a slice_api")
        self.config = config
        self.metrics = RouterMetrics(config.policy)
        self.picker = ReplicaPicker(
            config.policy,
            config.weights,
            config.prefill_rate_prior,
            per_replica_rate=config.per_replica_prefill_rate,
        )
        self._profiler = profiler
        if profiler is not None:
            profiler.context_limit = self._context_limit
        self._slice_api = slice_api
        self._tenant_policy = config.tenant_policy()
        self.fleet: Fleet | None = None
        self._watcher: EndpointSliceWatcher | None = None
        self._sessions: list[aiohttp.ClientSession] = []
        self._forwarder: Forwarder | None = None
        #: the client of the proxied requests (made on startup)
        self.upstream: UpstreamClient | None = None

    def build(self) -> web.Application:
        app = web.Application(client_max_size=self.config.upstream.max_body_bytes, middlewares=[json_errors])
        app.router.add_post(COMPLETIONS, self.inference)
        app.router.add_post(CHAT_COMPLETIONS, self.inference)
        app.router.add_get(MODELS, self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_route("*", "/{tail:.*}", self.unknown)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        upstream = self.config.upstream
        self.upstream = UpstreamClient(
            upstream.connect_timeout_s, upstream.request_timeout_s, upstream.upstream_read_bytes
        )
        poll_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=self.config.poll.timeout_s),
        )
        self._sessions = [poll_session]
        self.fleet = Fleet(
            poll_session,
            self.config.poll.interval_s,
            self.metrics,
            on_removed=self._forget,
        )
        vouch = self.config.router_token if self.config.trust_tenant_header else None
        self._forwarder = Forwarder(self.upstream, self.fleet.eject, vouch)
        if self.config.discovery.endpointslice_service:
            assert self._slice_api is not None
            self._watcher = self._start_watcher(self._slice_api)
        else:
            self.fleet.set_endpoints(Endpoint(url) for url in self.config.discovery.replicas)

    def _forget(self, url: str) -> None:
        if self._forwarder is not None:
            self._forwarder.forget(url)

    def _start_watcher(self, slice_api: Callable[[], SliceApi]) -> EndpointSliceWatcher:
        loop, fleet, discovery = asyncio.get_running_loop(), self.fleet, self.config.discovery
        assert fleet is not None and discovery.endpointslice_service and discovery.namespace

        def publish(endpoints: list[Endpoint]) -> None:
            if not loop.is_closed():  # the watch thread may outlive a stopping router by one event
                loop.call_soon_threadsafe(fleet.set_endpoints, endpoints)

        watcher = EndpointSliceWatcher(
            discovery.endpointslice_service, discovery.namespace, discovery.port_name, publish, slice_api
        )
        watcher.start()
        return watcher

    async def _stop(self, app: web.Application) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        if self.fleet is not None:
            await self.fleet.close()
        for session in self._sessions:
            await session.close()
        if self.upstream is not None:
            await self.upstream.close()

    def _context_limit(self) -> int | None:
        """The largest context limit the routable replicas report (None before any reports one)."""
        limits = (
            [r.load.max_model_len for r in self.fleet.routable() if r.load is not None] if self.fleet else []
        )
        return max(limits, default=0) or None

    # --- proxied endpoints ---------------------------------------------------------------------------

    async def inference(self, request: web.Request) -> web.StreamResponse:
        arrival = time.perf_counter()
        limits = self.config.upstream
        try:
            raw, body = await read_json_object(request, limits.max_body_bytes, limits.body_read_timeout_s)
            tenant = resolve_tenant(request.headers, self._tenant_policy)
        except BodyError as error:
            refusal = self._count(error_response(error.status, str(error), error.code, error.headers))
            if error.closes:
                await close_after(request, refusal)
            return refusal
        except TenantError as error:
            return self._count(error_response(400, str(error), "invalid_tenant"))
        profile = None
        if self._profiler is not None:
            try:
                profile = self._profiler.profile(request.path, body, tenant)
            except PromptError as error:
                log.debug("routing without locality: %s", error)
        return self._count(
            await self._route(
                request, raw, lambda candidates: self.picker.pick(candidates, profile), arrival, profile
            )
        )

    async def models(self, request: web.Request) -> web.StreamResponse:
        # Any ready replica answers; not a routing decision (nothing counted, nothing estimated).
        def least_busy(candidates: list[Replica]) -> tuple[Replica, None]:
            return min(candidates, key=lambda r: (len(r.in_flight), r.url)), None

        return self._count(await self._route(request, b"", least_busy, None, None))

    async def _route(
        self,
        request: web.Request,
        raw: bytes,
        choose: Choose,
        arrival: float | None,
        profile: RequestProfile | None,
    ) -> web.StreamResponse:
        """Choose, forward, and on a failure before the first byte retry once on another replica."""
        assert self.fleet is not None and self._forwarder is not None
        tried: set[str] = set()
        failure: UpstreamFailure | None = None
        for attempt in range(ATTEMPTS):
            candidates = [r for r in self.fleet.routable() if r.url not in tried]
            if not candidates:
                break
            if attempt:
                self.metrics.retries.inc()
            replica, decision = choose(candidates)
            tried.add(replica.url)
            dispatch = Dispatch(time.perf_counter(), 0, 0, 0)
            if decision is not None:
                dispatch = Dispatch(
                    dispatch.sent_at,
                    decision.prefill_work_tokens,
                    decision.uncached_tokens,
                    decision.kv_blocks,
                )
                self._count_decision(decision, profile)
            if profile is not None:
                dispatch.chains = replica.chains(profile)
            replica.begin(dispatch)  # counted in flight (metrics.InFlight) until replica.finish
            # the routing overhead: arrival → the first try's request going out to its replica
            written = (
                functools.partial(self._observe_overhead, arrival)
                if arrival is not None and not attempt
                else None
            )
            try:
                return await self._forwarder.forward(
                    request,
                    raw,
                    replica,
                    dispatch,
                    written,
                    self._observe_ttft(dispatch) if decision else None,
                )
            except UpstreamFailure as error:
                log.warning("request failed before its first byte: %s", error)
                failure = error
                if not error.replica_fault:
                    break  # this request's failure: the replica stays, and the request runs no second time
                self.fleet.eject(replica, error.reason)
            finally:
                replica.finish(dispatch, time.perf_counter())
        return self._no_answer(failure)

    def _observe_overhead(self, arrival: float) -> None:
        self.metrics.overhead.observe(time.perf_counter() - arrival)

    def _observe_ttft(self, dispatch: Dispatch) -> Callable[[], None]:
        def observe() -> None:
            # a 2xx only: an engine's refusal is no first token
            if dispatch.computed and dispatch.first_byte_at is not None:
                self.metrics.observed_ttft.observe(dispatch.first_byte_at - dispatch.sent_at)

        return observe

    def _count_decision(self, decision: Decision, profile: RequestProfile | None) -> None:
        self.metrics.decisions.labels(self.config.policy, decision.reason).inc()
        if decision.estimated_ttft_s is not None:
            self.metrics.estimated_ttft.observe(decision.estimated_ttft_s)
        if profile is not None:
            self.metrics.prompt_tokens.inc(profile.prompt_tokens)
            self.metrics.cached_prompt_tokens.inc(decision.cached_tokens)

    def _no_answer(self, failure: UpstreamFailure | None) -> web.Response:
        if failure is not None:
            return failure.client_response()
        # A replica becomes routable on a poll: worth asking again after the next one.
        retry_after = max(1, math.ceil(self.config.poll.interval_s))
        return error_response(
            503, "no engine replica is ready", "no_ready_replica", headers={"Retry-After": str(retry_after)}
        )

    def _count(self, response: web.StreamResponse) -> web.StreamResponse:
        self.metrics.responses.labels(str(response.status)).inc()
        return response

    # --- the router's own endpoints ------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        """200 when at least one engine replica is routable (the pod's readiness rule)."""
        replicas = list(self.fleet.replicas.values()) if self.fleet is not None else []
        routable = sum(1 for r in replicas if r.routable)
        body = {
            "ready": routable > 0,
            "routable": routable,
            "replicas": [
                {
                    "url": r.url,
                    "zone": r.zone,
                    "routable": r.routable,
                    "phase": r.load.phase if r.load is not None else None,
                    "ejected": r.eject_reason,
                }
                for r in replicas
            ],
        }
        return web.json_response(body, status=200 if routable else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})

    async def unknown(self, request: web.Request) -> web.Response:
        if request.path in (COMPLETIONS, CHAT_COMPLETIONS, MODELS, "/health", "/ready", "/metrics"):
            return error_response(
                405, f"{request.method} is not allowed on {request.path}", "method_not_allowed"
            )
        return error_response(404, f"no route for {request.path}", "not_found")
