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

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvpilot.engine.server.lifecycle import Phase
from kvpilot.engine.server.state import server_state

router = APIRouter()
# FastAPI's ``get`` routes GET alone (HEAD got 405); a probe or load balancer may ask with HEAD, which
# answers as GET does, its body dropped by uvicorn (headers, Content-Length included, stay)
_GET_AND_HEAD = ["GET", "HEAD"]


@router.api_route("/health", methods=_GET_AND_HEAD)
async def health(request: Request) -> JSONResponse:
    state = server_state(request)
    phase = state.lifecycle.phase
    alive = phase in (Phase.WARMING_UP, Phase.READY, Phase.DRAINING) and state.loop.healthy(time.monotonic())
    return JSONResponse(
        {"status": "ok" if alive else "unavailable", "phase": phase.value}, status_code=200 if alive else 503
    )


@router.api_route("/ready", methods=_GET_AND_HEAD)
async def ready(request: Request) -> JSONResponse:
    state = server_state(request)
    snap = state.lifecycle.snapshot()
    return JSONResponse({"model": state.model_name, **snap.to_json()}, status_code=200 if snap.ready else 503)


@router.api_route("/load", methods=_GET_AND_HEAD)
async def load(request: Request) -> JSONResponse:
    state = server_state(request)
    phase = state.lifecycle.phase
    return JSONResponse({**state.loop.load, "ready": phase is Phase.READY, "phase": phase.value})


@router.api_route("/metrics", methods=_GET_AND_HEAD)
async def metrics(request: Request) -> Response:
    return Response(generate_latest(server_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.api_route("/v1/models", methods=_GET_AND_HEAD)
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
