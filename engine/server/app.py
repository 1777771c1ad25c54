"""Wiring: the shared server state (metrics, lifecycle, engine loop, tracer, rate limiter) and the FastAPI
app around it. The engine loop thread starts with the app (so probes answer while the model loads) and
stops with it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry
from starlette.concurrency import run_in_threadpool

from kvpilot import __version__
from kvpilot.engine.config import EngineConfig
from kvpilot.engine.server import chat, completions, kv_routes, ops_routes
from kvpilot.engine.server.config import ServerConfig
from kvpilot.engine.server.engine_info import placeholder_load, served_model_name
from kvpilot.engine.server.engine_loop import EngineLoop
from kvpilot.engine.server.errors import install_error_handlers
from kvpilot.engine.server.ingress import IngressGate
from kvpilot.engine.server.lifecycle import Lifecycle
from kvpilot.engine.server.metrics import ServerMetrics
from kvpilot.engine.server.rate_limit import TenantRateLimiter
from kvpilot.engine.server.state import ServerState
from kvpilot.engine.server.tracing import INSTRUMENTATION_NAME

if TYPE_CHECKING:
    from kvpilot.engine.engine_core import LLMEngine


def _load_engine(engine_config: EngineConfig) -> Callable[[], LLMEngine]:
    def load() -> LLMEngine:
        from kvpilot.engine.engine_core import LLMEngine  # torch: imported on the engine thread

        return LLMEngine(engine_config)

    return load


def build_state(
    engine_config: EngineConfig,
    config: ServerConfig,
    *,
    engine_factory: Callable[[], LLMEngine] | None = None,
    tracer_provider: TracerProvider | None = None,
    registry: CollectorRegistry | None = None,
    on_fatal: Callable[[str], None] = lambda reason: None,
) -> ServerState:
    """``engine_factory`` builds the engine on the engine thread (default: ``LLMEngine(engine_config)``)."""
    model_name = served_model_name(engine_config)
    metrics = ServerMetrics(model_name, config.slo_ttft_s, config.slo_tpot_s, registry)
    lifecycle = Lifecycle(on_phase_timed=metrics.startup_phase)
    loop = EngineLoop(
        engine_factory or _load_engine(engine_config),
        config,
        lifecycle,
        metrics,
        placeholder_load(engine_config),
        on_fatal,
    )
    limiter = None
    if config.tenant_rate_limit > 0:
        limiter = TenantRateLimiter(
            config.tenant_rate_limit, config.effective_tenant_burst, config.max_tracked_tenants
        )
    tracer = None
    if tracer_provider is not None:
        tracer = tracer_provider.get_tracer(INSTRUMENTATION_NAME, __version__)
    metrics.attach_gauges(lambda: loop.load, lambda: lifecycle.phase.value)
    return ServerState(
        config=config,
        engine_config=engine_config,
        model_name=model_name,
        lifecycle=lifecycle,
        metrics=metrics,
        loop=loop,
        tracer=tracer,
        rate_limiter=limiter,
    )


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop.start()
        yield
        await run_in_threadpool(state.loop.stop)

    app = FastAPI(
        title="kvpilot engine server",
        version=__version__,
        lifespan=lifespan,
        description="OpenAI-compatible completions and chat on the kvpilot engine, with probes, "
        "load and prefix-cache endpoints for the kvpilot router.",
    )
    app.state.kvpilot = state
    install_error_handlers(app, state.metrics.rejected)
    for module in (completions, chat, ops_routes, kv_routes):
        app.include_router(module.router)
    app.add_middleware(IngressGate, state=state)
    return app
