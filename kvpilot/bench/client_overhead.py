"""Measuring the load generator itself, so a run can show the client was not the bottleneck.

Event-loop lag: a task asks to wake every ``interval_s`` and records how late it woke. Lateness means
callbacks (response reads, request sends) waited that long for the loop, and every client-side timestamp
can be off by as much. CPU utilisation is process CPU time over wall time (1.0 = one core fully busy;
it includes any other threads of this process).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ClientOverhead:
    wall_s: float  # how long the monitor ran
    cpu_utilization: float  # process CPU seconds per wall second over that time
    loop_lag_samples: int
    loop_lag_mean_s: float | None
    loop_lag_p99_s: float | None
    loop_lag_max_s: float | None


class LoopLagMonitor:
    """Start with :meth:`start` inside a running loop; :meth:`stop` returns the overhead figures."""

    def __init__(self, interval_s: float = 0.005):
        self._interval_s = interval_s
        self._lags: list[float] = []
        self._task: asyncio.Task | None = None
        self._wall0 = 0.0
        self._cpu0 = 0.0

    def start(self) -> None:
        self._wall0, self._cpu0 = time.perf_counter(), time.process_time()
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            due = time.perf_counter() + self._interval_s
            await asyncio.sleep(self._interval_s)
            self._lags.append(max(0.0, time.perf_counter() - due))

    async def stop(self) -> ClientOverhead:
        if self._task is None:
            raise RuntimeError("LoopLagMonitor.stop() before start()")
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        wall = time.perf_counter() - self._wall0
        cpu = time.process_time() - self._cpu0
        lags = np.asarray(self._lags)
        has = lags.size > 0
        return ClientOverhead(
            wall_s=wall,
            cpu_utilization=cpu / wall if wall > 0 else 0.0,
            loop_lag_samples=int(lags.size),
            loop_lag_mean_s=float(lags.mean()) if has else None,
            loop_lag_p99_s=float(np.percentile(lags, 99)) if has else None,
            loop_lag_max_s=float(lags.max()) if has else None,
        )
