"""Everything one server process shares between its HTTP handlers, and what the ingress gate learned about
a request before the handler runs (its arrival time and tenant)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Request
from opentelemetry.trace import Tracer

from kvpilot.engine.config import EngineConfig
from kvpilot.engine.server.config import ServerConfig
from kvpilot.engine.server.engine_info import EngineInfo
from kvpilot.engine.server.engine_loop import EngineLoop
from kvpilot.engine.server.errors import APIError
from kvpilot.engine.server.lifecycle import Lifecycle, Phase
from kvpilot.engine.server.metrics import ServerMetrics
from kvpilot.engine.server.rate_limit import TenantRateLimiter

SCOPE_KEY = "kvpilot"


@dataclass(frozen=True)
class RequestContext:
    #: monotonic time the request reached the server (TTFT / E2E / queue-deadline boundary)
    arrival: float
    #: the same moment on the wall clock, for the trace span's start
    arrival_ns: int
    #: ``tenant_from_headers``: the prefix-cache salt and the rate-limit key (None = anonymous, shared)
    tenant: str | None
    headers: dict[str, str]


@dataclass
class ServerState:
    config: ServerConfig
    engine_config: EngineConfig
    model_name: str
    lifecycle: Lifecycle
    metrics: ServerMetrics
    loop: EngineLoop
    tracer: Tracer | None
    rate_limiter: TenantRateLimiter | None
    #: inference HTTP requests being served right now (the drain waits for 0)
    inflight: int = 0
    #: wall-clock start of the process's server (``created`` of the model card)
    started_at: float = field(default_factory=time.time)

    @property
    def info(self) -> EngineInfo:
        info = self.loop.info
        if info is None or self.lifecycle.phase is not Phase.READY:
            raise not_ready(self)
        return info

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                code="model_not_found",
                param="model",
            )


def not_ready(state: ServerState) -> APIError:
    phase = state.lifecycle.phase
    if phase is Phase.DRAINING:
        return APIError(
            503,
            "the server is draining (shutting down); send the request to another replica",
            code="draining",
            retry_after=state.config.retry_after_s,
        )
    return APIError(
        503,
        f"the server is not ready (phase {phase.value}); see /ready",
        code="not_ready",
        retry_after=state.config.retry_after_s,
    )


def server_state(request: Request) -> ServerState:
    return request.app.state.kvpilot


def request_context(request: Request) -> RequestContext:
    return request.scope[SCOPE_KEY]
