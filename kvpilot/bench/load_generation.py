"""Issuing requests: open loop on a fixed schedule, closed loop with N busy clients, and warm-up.

Open loop: the schedule (``kvpilot.bench.arrivals``) and the requests are built before the clock starts,
then a dispatcher sleeps until each scheduled time and starts the request as its own task, never waiting
for earlier ones. Each record keeps the scheduled time (the latency origin) and the actual send time, so
a client that fell behind shows up as send lag and its lateness still counts as latency.

Closed loop: ``concurrency`` clients each send a request, wait for it to finish, and send the next; a
request's arrival is the moment its client became free. The offered load thus follows the server's speed,
which hides overload -- these numbers answer "how fast at N in flight", not "what latency at rate R".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence

from kvpilot.bench.records import PHASE_MEASURED, PHASE_WARMUP, RequestRecord
from kvpilot.bench.sse_client import OpenAIStreamClient
from kvpilot.bench.workloads import RequestSpec

#: called with each finished record (its return value is ignored, so e.g. a progress bar's update fits)
OnDone = Callable[[RequestRecord], object]


async def run_open_loop(
    client: OpenAIStreamClient,
    schedule: Sequence[tuple[float, RequestSpec]],
    *,
    max_concurrency: int | None = None,
    on_done: OnDone | None = None,
) -> list[RequestRecord]:
    """Send each ``(offset_s, spec)`` at its offset from now; records come back in schedule order.

    ``max_concurrency`` caps requests in flight on the client side: a request due while the cap is full
    waits for a slot, and that wait is part of its latency.
    """
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency is not None else None
    tasks: list[asyncio.Task[RequestRecord]] = []
    t0 = time.perf_counter()
    for offset, spec in schedule:
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(
            client.send(spec, phase=PHASE_MEASURED, t0=t0, scheduled_s=float(offset), gate=gate)
        )
        if on_done is not None:
            task.add_done_callback(lambda done: on_done(done.result()) if _succeeded(done) else None)
        tasks.append(task)
    return list(await asyncio.gather(*tasks))


def _succeeded(task: asyncio.Task) -> bool:
    # A cancelled or crashed task has no record; gather() reports it, the callback must not raise.
    return not task.cancelled() and task.exception() is None


async def run_closed_loop(
    client: OpenAIStreamClient,
    specs: Iterator[RequestSpec],
    *,
    concurrency: int,
    num_requests: int | None,
    duration_s: float | None,
    on_done: OnDone | None = None,
) -> list[RequestRecord]:
    """``concurrency`` clients send back to back until ``num_requests`` were issued or ``duration_s``
    passed (whichever first); records come back in issue order."""
    if num_requests is None and duration_s is None:
        raise ValueError("a closed loop needs num_requests or duration_s")
    records: list[RequestRecord] = []
    issued = 0
    t0 = time.perf_counter()

    def more_to_send() -> bool:
        if num_requests is not None and issued >= num_requests:
            return False
        return duration_s is None or time.perf_counter() - t0 < duration_s

    async def one_client() -> None:
        nonlocal issued
        while more_to_send():
            issued += 1
            spec = next(specs)
            now = time.perf_counter() - t0
            record = await client.send(spec, phase=PHASE_MEASURED, t0=t0, scheduled_s=now)
            records.append(record)
            if on_done is not None:
                on_done(record)

    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    return sorted(records, key=lambda record: record.index)


async def run_warmup(
    client: OpenAIStreamClient, specs: Iterator[RequestSpec], count: int
) -> list[RequestRecord]:
    """``count`` requests one after another; the first ones against a fresh server show its cold start."""
    records = []
    t0 = time.perf_counter()
    for _ in range(count):
        spec = next(specs)
        now = time.perf_counter() - t0
        records.append(await client.send(spec, phase=PHASE_WARMUP, t0=t0, scheduled_s=now))
    return records
