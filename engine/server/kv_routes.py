"""``/kv/events`` and ``/kv/snapshot``: the prefix cache's hashes for routers
(docs/engine-router-contract.md).

``/kv/events?since=SEQ`` reads the engine's thread-safe event log directly (ordered, gap-free sequence
numbers; ``gap: true`` when events after SEQ were dropped or SEQ lies in the future). ``/kv/snapshot``
must pair the hash set with the sequence number it corresponds to, so the engine loop takes it between
two steps; it is served once the engine is running (503 before, as the events are).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from kvpilot.engine.server.engine_info import EngineInfo
from kvpilot.engine.server.errors import APIError
from kvpilot.engine.server.lifecycle import Phase
from kvpilot.engine.server.state import ServerState, server_state

router = APIRouter()
SNAPSHOT_TIMEOUT_S = 10.0


def _engine_info(request: Request) -> tuple[ServerState, EngineInfo]:
    state = server_state(request)
    phase = state.lifecycle.phase
    if state.loop.info is None or phase not in (Phase.WARMING_UP, Phase.READY, Phase.DRAINING):
        raise APIError(
            503,
            f"the engine is not running (phase {phase.value})",
            code="not_ready",
            retry_after=state.config.retry_after_s,
        )
    return state, state.loop.info


@router.get("/kv/events")
async def kv_events(
    request: Request, since: int = Query(0, ge=0, description="last seq the reader has")
) -> JSONResponse:
    _, info = _engine_info(request)
    batch = info.kv_events.since(since)
    return JSONResponse(
        {
            "epoch": batch.epoch,
            "seq": batch.seq,
            "gap": batch.gap,
            "block_size": info.block_size,
            "root": info.root_hex,
            "events": [e.to_json() for e in batch.events],
        }
    )


@router.get("/kv/snapshot")
async def kv_snapshot(request: Request) -> JSONResponse:
    state, info = _engine_info(request)
    if state.lifecycle.phase is Phase.WARMING_UP:  # the loop is busy warming up, not taking commands
        raise APIError(
            503, "the engine is warming up", code="not_ready", retry_after=state.config.retry_after_s
        )
    try:
        snap = await asyncio.wait_for(asyncio.wrap_future(state.loop.kv_snapshot()), SNAPSHOT_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise APIError(
            503,
            "the engine loop did not answer in time",
            code="engine_busy",
            retry_after=state.config.retry_after_s,
        ) from None
    return JSONResponse(
        {
            "epoch": snap["epoch"],
            "seq": snap["seq"],
            "block_size": info.block_size,
            "root": info.root_hex,
            "block_hashes": snap["block_hashes"],
        }
    )
