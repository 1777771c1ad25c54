"""Graceful shutdown after SIGTERM (a pod being deleted or rolled):

1. phase → draining: ``/ready`` answers 503 (Kubernetes stops routing here), ``/load`` says so to routers,
   new inference requests get 503 + Retry-After (a router retries them on another replica);
2. requests that have not started (pending admission or queued) are answered 503 at once — nothing was
   sent, so they are retried elsewhere instead of waiting out the grace period here;
3. running requests keep streaming until they finish, for at most ``grace_s`` seconds;
4. then whatever is left is cancelled (its client gets an error: a 503 if nothing was sent yet, an error
   event on a stream), the engine loop stops, and the server exits.
"""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.concurrency import run_in_threadpool

from kvpilot.engine.server.lifecycle import Phase
from kvpilot.engine.server.state import ServerState

log = logging.getLogger(__name__)
POLL_S = 0.05
#: after cancelling the stragglers, how long their handlers get to send their last bytes
FLUSH_S = 5.0


async def _wait_idle(state: ServerState, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while state.inflight > 0 and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    return state.inflight == 0


async def drain(state: ServerState, grace_s: float) -> None:
    detail = f"finishing in-flight requests (grace {grace_s:g} s)"
    if not state.lifecycle.enter(Phase.DRAINING, detail=detail):
        return
    log.info("draining: %d in-flight requests, grace %g s", state.inflight, grace_s)
    state.loop.drain()
    if await _wait_idle(state, grace_s):
        log.info("drained: every in-flight request finished")
        return
    log.warning("grace period over: cancelling %d in-flight requests", state.inflight)
    await run_in_threadpool(state.loop.stop)
    await _wait_idle(state, FLUSH_S)
