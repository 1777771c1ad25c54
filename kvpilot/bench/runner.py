"""Running a whole ``bench serve`` benchmark: readiness, model, warm-up, each load point, saturation.

Seeding: one ``SeedSequence(seed)`` is split into independent streams for arrivals, tenants' system
prompts, warm-up requests and each load point's requests. Every point restarts the arrival stream, so all
points see the same arrival pattern rescaled to their rate. Each point gets fresh prompts from the same
length distribution: repeating the previous point's prompts would let a prefix cache serve them from
cache and flatter every later point. Shared-prefix tenants keep their system prompts for the whole run.
"""

from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

import aiohttp
import numpy as np
from tqdm import tqdm

from kvpilot.bench.arrivals import arrival_offsets
from kvpilot.bench.client_overhead import ClientOverhead, LoopLagMonitor
from kvpilot.bench.config import ServeBenchConfig
from kvpilot.bench.context_fit import ContextFit, fit_to_context
from kvpilot.bench.endpoint import EndpointError, ReadyResult, resolve_model, wait_until_ready
from kvpilot.bench.load_generation import run_closed_loop, run_open_loop, run_warmup
from kvpilot.bench.metrics import PointSummary, summarize
from kvpilot.bench.records import RequestRecord
from kvpilot.bench.saturation import SaturationResult, SweepPoint, find_saturation
from kvpilot.bench.sse_client import OpenAIStreamClient
from kvpilot.bench.workloads import Workload


@dataclass
class PointResult:
    mode: str  # "open" or "closed"
    load: float  # request rate in req/s (open; may be inf) or concurrency (closed)
    label: str  # human-readable load description
    records: list[RequestRecord]
    summary: PointSummary
    overhead: ClientOverhead


@dataclass
class ColdStart:
    ready: ReadyResult | None  # None when no ready URL was polled
    warmup_records: list[RequestRecord] = field(default_factory=list)


@dataclass
class BenchmarkResult:
    model: str
    started_at: str  # ISO 8601, UTC
    cold_start: ColdStart
    points: list[PointResult]
    saturation: SaturationResult | None  # only for sweeps (two or more points)
    context_fit: ContextFit | None = None  # the lengths fitted to the served context (None: not fitted)


def point_label(config: ServeBenchConfig, load: float) -> str:
    if config.load.mode == "closed":
        return f"closed loop, concurrency {int(load)}"
    shape = "Poisson" if config.load.burstiness == 1.0 else f"gamma, burstiness {config.load.burstiness:g}"
    rate = "inf (all at t=0)" if math.isinf(load) else f"{load:g} req/s ({shape})"
    cap = "" if config.load.max_concurrency is None else f", client cap {config.load.max_concurrency}"
    return f"open loop, rate {rate}{cap}"


async def run_serve_benchmark(
    config: ServeBenchConfig, on_point: Callable[[PointResult], None] | None = None
) -> BenchmarkResult:
    """Run the benchmark ``config`` describes; ``on_point`` sees each load point as it finishes.

    Raises :class:`kvpilot.bench.endpoint.EndpointError` when the endpoint is unreachable or not ready,
    or when every warm-up request failed (then the load would measure nothing but the failure).
    """
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    endpoint = config.endpoint
    arrival_seed, tenant_seed, warmup_seed, request_root = np.random.SeedSequence(config.seed).spawn(4)
    workload = Workload(config.workload, tenant_seed)  # reads a dataset file before any network
    request_seeds = request_root.spawn(len(config.load.levels))
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    # No connection-pool cap: a hidden cap would queue requests where the send-lag figures cannot see it.
    connector = aiohttp.TCPConnector(limit=0, force_close=not endpoint.keep_alive)
    timeout = aiohttp.ClientTimeout(total=endpoint.request_timeout_s, sock_connect=endpoint.connect_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        ready = None
        if endpoint.ready_url is not None:
            ready = await wait_until_ready(session, endpoint.ready_url, endpoint.ready_timeout_s)
        served = await resolve_model(session, endpoint.base_url, endpoint.model, endpoint.connect_timeout_s)
        model = served.id
        client = OpenAIStreamClient(session, endpoint, model)
        context_fit = await fit_to_context(client, config.workload, served)
        if context_fit is not None and context_fit.scale < 1:
            workload = Workload(context_fit.workload, tenant_seed)
        warmup = await run_warmup(
            client, workload.stream(np.random.default_rng(warmup_seed)), config.load.warmup_requests
        )
        if warmup and not any(record.ok for record in warmup):
            first = warmup[0]
            raise EndpointError(
                f"all {len(warmup)} warm-up requests failed, the first with {first.error_type}: "
                f"{first.error_detail}"
            )
        points = []
        for load, request_seed in zip(config.load.levels, request_seeds, strict=True):
            point = await _run_point(config, client, workload, load, arrival_seed, request_seed)
            points.append(point)
            if on_point is not None:
                on_point(point)

    saturation = None
    if len(points) >= 2:
        sweep = [
            SweepPoint(
                load=p.load,
                achieved_rps=p.summary.request_throughput_rps,
                offered_rps=p.summary.arrival_rate_rps,
                latency_s=p.summary.latency(config.saturation.latency),
            )
            for p in points
        ]
        saturation = find_saturation(sweep, config.saturation, open_loop=config.load.mode == "open")
    return BenchmarkResult(
        model=model,
        started_at=started_at,
        cold_start=ColdStart(ready, warmup),
        points=points,
        saturation=saturation,
        context_fit=context_fit,
    )


async def _run_point(
    config: ServeBenchConfig,
    client: OpenAIStreamClient,
    workload: Workload,
    load: float,
    arrival_seed: np.random.SeedSequence,
    request_seed: np.random.SeedSequence,
) -> PointResult:
    plan = config.load
    specs = workload.stream(np.random.default_rng(request_seed))
    label = point_label(config, load)
    monitor = LoopLagMonitor()
    if plan.mode == "open":
        offsets = arrival_offsets(
            load,
            plan.burstiness,
            np.random.default_rng(arrival_seed),
            count=plan.num_requests,
            duration_s=plan.duration_s,
        )
        # Requests are built before the clock starts so the dispatcher only sleeps and sends.
        schedule = [(float(offset), next(specs)) for offset in offsets]
        with _progress(config, label, len(schedule)) as bar:
            monitor.start()
            records = await run_open_loop(
                client, schedule, max_concurrency=plan.max_concurrency, on_done=lambda _record: bar.update()
            )
            overhead = await monitor.stop()
    else:
        with _progress(config, label, plan.num_requests) as bar:
            monitor.start()
            records = await run_closed_loop(
                client,
                specs,
                concurrency=int(load),
                num_requests=plan.num_requests,
                duration_s=plan.duration_s,
                on_done=lambda _record: bar.update(),
            )
            overhead = await monitor.stop()
    return PointResult(
        mode=plan.mode,
        load=load,
        label=label,
        records=records,
        summary=summarize(records, config.slo),
        overhead=overhead,
    )


def _progress(config: ServeBenchConfig, label: str, total: int | None) -> tqdm:
    return tqdm(
        total=total,
        desc=label,
        unit="req",
        file=sys.stderr,
        leave=False,
        disable=not config.show_progress,
        dynamic_ncols=True,
    )


def run_serve_benchmark_sync(
    config: ServeBenchConfig, on_point: Callable[[PointResult], None] | None = None
) -> BenchmarkResult:
    """:func:`run_serve_benchmark` in a fresh event loop."""
    return asyncio.run(run_serve_benchmark(config, on_point))
