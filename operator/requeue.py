"""The reconcile queue: what makes watch events, follow-ups and the resync timer one orderly stream of
reconciles per InferenceService (docs/architecture.md#watches-and-resync).

- **One at a time per service**: a reconcile of ``(namespace, name)`` never overlaps another of the same
  key (two would race to create the same child, and write status from different observations).
- **Coalescing**: a trigger while a reconcile waits to start adds nothing, since that reconcile has not
  read anything yet and will see the change; a trigger while one runs queues exactly one more. A burst
  of events (a rollout's pod updates, the first reconcile's own creates) costs at most two passes.
- **Later**: ``trigger(key, delay)`` keeps the earliest pending follow-up per key, so repeated requests
  for "ask again in 10 s" do not pile up.
- **Failures** are retried after ``retry_delay``; nothing here ever raises into the caller.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)
Key = tuple[str, str]  # (namespace, name) of an InferenceService


class Requeue:
    def __init__(self, reconcile: Callable[[Key], Awaitable[None]], retry_delay: float = 10.0) -> None:
        self._reconcile, self._retry_delay = reconcile, retry_delay
        self._locks: dict[Key, asyncio.Lock] = {}
        self._waiting: set[Key] = set()  # a reconcile is queued and has not started reading yet
        self._later: dict[Key, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def trigger(self, key: Key, delay: float = 0.0) -> None:
        """Reconcile ``key`` now (or in ``delay`` seconds); call from the event loop."""
        loop = asyncio.get_running_loop()
        if delay > 0:
            pending = self._later.get(key)
            if pending is None or pending.when() > loop.time() + delay:
                if pending is not None:
                    pending.cancel()
                self._later[key] = loop.call_later(delay, self._due, key)
            return
        if key in self._waiting:
            return
        self._waiting.add(key)
        task = loop.create_task(self._run(key), name=f"reconcile {key[0]}/{key[1]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _due(self, key: Key) -> None:
        self._later.pop(key, None)
        self.trigger(key)

    async def _run(self, key: Key) -> None:
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            self._waiting.discard(key)  # from here on a change may be missed: the next trigger runs again
            try:
                await self._reconcile(key)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reconcile of %s/%s failed; retrying in %gs", *key, self._retry_delay)
                self.trigger(key, self._retry_delay)

    def forget(self, key: Key) -> None:
        """The InferenceService is gone: drop its pending follow-up and its lock."""
        pending = self._later.pop(key, None)
        if pending is not None:
            pending.cancel()
        lock = self._locks.get(key)
        if lock is not None and not lock.locked() and key not in self._waiting:
            del self._locks[key]

    @property
    def pending(self) -> int:
        """Reconciles queued or running, plus follow-ups scheduled (for tests and debugging)."""
        return len(self._tasks) + len(self._later)
