"""Keeps one replica's state current: ``/load`` and ``/kv/events`` every poll interval, concurrently.

A failed or slow ``/load`` ejects the replica at once (the next successful poll sent after the failure
re-admits it if it says ready). A failed ``/kv/*`` call only invalidates the prefix index, since the engine
may still serve well; the next poll resyncs it from ``/kv/snapshot``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Protocol

import aiohttp

from kvpilot.router.engine_load import EngineLoad, LoadFormatError
from kvpilot.router.prefix_index import KVFormatError
from kvpilot.router.replica import Replica

log = logging.getLogger(__name__)
TIMEOUT, ERROR, NOT_READY = "timeout", "error", "not_ready"


class PollListener(Protocol):
    def on_eject(self, replica: Replica, reason: str, was_routable: bool) -> None: ...
    def on_load(self, replica: Replica, was_routable: bool) -> None: ...
    def on_resync(self, replica: Replica) -> None: ...


class PollError(Exception):
    """A poll answered something other than HTTP 200 with JSON."""


class ReplicaPoller:
    def __init__(
        self, replica: Replica, session: aiohttp.ClientSession, interval_s: float, listener: PollListener
    ) -> None:
        self.replica = replica
        self._session = session
        self._interval_s = interval_s
        self._listener = listener

    async def run(self) -> None:
        while True:
            started = time.perf_counter()
            await self.poll_once()
            await asyncio.sleep(max(0.0, self._interval_s - (time.perf_counter() - started)))

    async def poll_once(self) -> None:
        await asyncio.gather(self._poll_load(), self._poll_kv())

    async def _poll_load(self) -> None:
        replica = self.replica
        sent_at = time.perf_counter()
        try:
            load = EngineLoad.from_json(await self._get_json("/load"))
        except asyncio.TimeoutError:  # the builtin TimeoutError only from 3.11 on (aiohttp raises this)
            self._eject(TIMEOUT, sent_at, "/load timed out")
            return
        except (aiohttp.ClientError, PollError, LoadFormatError) as error:
            self._eject(ERROR, sent_at, f"/load failed: {error}")
            return
        was_routable = replica.routable
        replica.accept_load(load, sent_at)
        if was_routable and not replica.routable:
            log.warning("replica %s stopped being ready (phase %s)", replica.url, load.phase)
            self._listener.on_eject(replica, NOT_READY, True)
        self._listener.on_load(replica, was_routable)

    async def _poll_kv(self) -> None:
        index = self.replica.index
        sent_at = time.perf_counter()
        try:
            if index.synced and index.apply_events(await self._get_json(f"/kv/events?since={index.seq}")):
                self.replica.kv_applied(sent_at)
                return
            # First sync, a gap, or a new epoch: start over from the full set.
            sent_at = time.perf_counter()
            index.apply_snapshot(await self._get_json("/kv/snapshot"))
            self.replica.kv_applied(sent_at)
            self._listener.on_resync(self.replica)
        except (asyncio.TimeoutError, aiohttp.ClientError, PollError, KVFormatError) as error:
            if index.synced:
                log.warning("replica %s: prefix index dropped until resync: %s", self.replica.url, error)
            index.invalidate()

    def _eject(self, reason: str, now: float, detail: str) -> None:
        was_routable = self.replica.eject(reason, now)
        if was_routable:
            log.warning("replica %s ejected (%s): %s", self.replica.url, reason, detail)
        self._listener.on_eject(self.replica, reason, was_routable)

    async def _get_json(self, path: str) -> Any:
        async with self._session.get(self.replica.url + path) as response:
            if response.status != 200:
                raise PollError(f"HTTP {response.status} from {path}")
            try:
                return json.loads(await response.read())
            except ValueError as error:
                raise PollError(f"{path} did not answer JSON: {error}") from None
