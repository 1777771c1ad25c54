"""The set of engine replicas one router routes to: follows discovery (static list or EndpointSlices),
runs a poller per replica, and keeps the replica metrics (routable count, ejections, resyncs) in step."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable

import aiohttp

from kvpilot.router.endpointslices import Endpoint
from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.poller import ReplicaPoller
from kvpilot.router.replica import Replica


class Fleet:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        poll_interval_s: float,
        metrics: RouterMetrics,
        on_removed: Callable[[str], None] | None = None,
    ) -> None:
        """``on_removed(url)`` runs when discovery drops a replica (e.g. to close its connections)."""
        self.replicas: dict[str, Replica] = {}
        self._pollers: dict[str, asyncio.Task[None]] = {}
        self._session = session
        self._interval_s = poll_interval_s
        self._metrics = metrics
        self._on_removed = on_removed
        #: set whenever some replica becomes routable (lets startup and tests wait without sleeping)
        self.changed = asyncio.Event()
        metrics.in_flight.source = lambda: [(url, len(r.in_flight)) for url, r in self.replicas.items()]

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        """Make the fleet exactly ``endpoints``: start polling new ones, drop the missing ones (their
        in-flight requests finish on their own). Call on the router's event loop."""
        wanted = {e.url: e for e in endpoints}
        for url in list(self.replicas):
            if url not in wanted:
                del self.replicas[url]
                self._pollers.pop(url).cancel()
                self._metrics.forget_replica(url)
                if self._on_removed is not None:
                    self._on_removed(url)
        for url, endpoint in wanted.items():
            replica = self.replicas.get(url)
            if replica is not None:
                replica.zone, replica.pod = endpoint.zone, endpoint.pod
                continue
            replica = self.replicas[url] = Replica(url, endpoint.zone, endpoint.pod)
            poller = ReplicaPoller(replica, self._session, self._interval_s, self)
            self._pollers[url] = asyncio.get_running_loop().create_task(poller.run(), name=f"poll {url}")
        self._refresh_gauges()

    def routable(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.routable]

    def eject(self, replica: Replica, reason: str) -> None:
        """A proxied request to ``replica`` failed: stop routing there until a later poll finds it ready."""
        self.on_eject(replica, reason, replica.eject(reason, time.perf_counter()))

    async def close(self) -> None:
        tasks = list(self._pollers.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._pollers.clear()

    def _member(self, replica: Replica) -> bool:
        """Whether ``replica`` is (still) in the fleet: a removed one's late failures and polls are not
        counted, or they would bring back the series its removal dropped."""
        return self.replicas.get(replica.url) is replica

    # PollListener
    def on_eject(self, replica: Replica, reason: str, was_routable: bool) -> None:
        if was_routable and self._member(replica):
            self._metrics.ejections.labels(replica.url, reason).inc()
        self._refresh_gauges()

    def on_load(self, replica: Replica, was_routable: bool) -> None:
        if replica.routable and not was_routable:
            self.changed.set()
        self._refresh_gauges()

    def on_resync(self, replica: Replica) -> None:
        if self._member(replica):
            self._metrics.kv_resyncs.labels(replica.url).inc()

    def _refresh_gauges(self) -> None:
        self._metrics.known.set(len(self.replicas))
        self._metrics.routable.set(sum(1 for r in self.replicas.values() if r.routable))
