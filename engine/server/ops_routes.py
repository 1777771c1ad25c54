"""Operational endpoints: probes, load, metrics, the model list.

- ``/health`` (liveness, the pod's startup and liveness probes): 200 while the engine loop runs — warming
  up, ready or draining — and its last iteration is recent; 503 while loading (the startup probe's budget
  covers weight loading), after a failure, or when one iteration has hung past ``--loop-stall-timeout``.
- ``/ready`` (readiness): 200 only in phase ready; the body always tells ``phase`` and progress.
- ``/load``: the engine loop's latest snapshot (docs/engine-router-contract.md) plus ``ready``/``phase``
  read at request time, so a drain shows at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvpilot.engine.server.lifecycle import Phase
from kvpilot.engine.server.state import server_state

router = APIRouter()
Endpoint = TypeVar("Endpoint", bound=Callable[..., Any])


def _get_and_head(path: str) -> Callable[[Endpoint], Endpoint]:
    """Route GET and HEAD to the endpoint: FastAPI's ``get`` routes GET alone (HEAD got 405), and a probe or
    load balancer may ask with HEAD, answered as GET is, its body dropped by uvicorn (headers, Content-Length
    included, stay). Two routes, not one with both methods, so that each operation has its own OpenAPI id."""

    def register(endpoint: Endpoint) -> Endpoint:
        router.add_api_route(path, endpoint, methods=["GET"])
        router.add_api_route(path, endpoint, methods=["HEAD"], operation_id=f"{endpoint.__name__}_head")
        return endpoint

    return register


@_get_and_head("/health")
async def health(request: Request) -> JSONResponse:
    state = server_state(request)
    phase = state.lifecycle.phase
    alive = phase in (Phase.WARMING_UP, Phase.READY, Phase.DRAINING) and state.loop.healthy(time.monotonic())
    return JSONResponse(
        {"status": "ok" if alive else "unavailable", "phase": phase.value}, status_code=200 if alive else 503
    )


@_get_and_head("/ready")
async def ready(request: Request) -> JSONResponse:
    state = server_state(request)
    snap = state.lifecycle.snapshot()
    return JSONResponse({"model": state.model_name, **snap.to_json()}, status_code=200 if snap.ready else 503)


@_get_and_head("/load")
async def load(request: Request) -> JSONResponse:
    state = server_state(request)
    phase = state.lifecycle.phase
    return JSONResponse({**state.loop.load, "ready": phase is Phase.READY, "phase": phase.value})


@_get_and_head("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(server_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


@_get_and_head("/v1/models")
async def models(request: Request) -> JSONResponse:
    state = server_state(request)
    info = state.loop.info
    card = {
        "id": state.model_name,
        "object": "model",
        "created": int(state.started_at),
        "owned_by": "kvpilot",
        "root": state.engine_config.model.model,
        "max_model_len": info.max_model_len if info else None,
    }
    return JSONResponse({"object": "list", "data": [card]})
