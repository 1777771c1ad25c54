"""The commands HTTP handlers send the engine loop's thread (``engine_loop.EngineLoop``) over its queue,
and what a KV snapshot command answers. Each is handled on the engine thread, in the order sent."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpilot.engine.server.serving_request import ServingRequest

if TYPE_CHECKING:  # torch: the engine is imported on the engine thread (app.py)
    from kvpilot.engine.engine_core import LLMEngine


@dataclass
class Submit:
    """One HTTP request's engine requests (one per prompt and choice) to admit."""

    batch: list[ServingRequest]


@dataclass
class Abort:
    """Requests whose clients went away or whose queue deadline passed: reclaimed at once."""

    request_ids: list[str]


@dataclass
class Resume:
    """A paused stream's client has read its buffer: decode it again."""

    request_id: str


@dataclass
class KVSnapshot:
    """A router's prefix-cache resync (``GET /kv/snapshot``): answered with ``kv_snapshot``."""

    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class Drain:
    """Stop admitting (the pod is terminating); what is running finishes."""


class Stop:
    """End the loop; open requests are cancelled."""


def kv_snapshot(engine: LLMEngine) -> dict:
    """The KV event log's epoch and position, and the hash of every cached block: the set a router resyncs
    to before reading events after ``seq`` (docs/architecture.md#engine-and-router)."""
    return {
        "epoch": engine.kv_events.epoch,
        "seq": engine.kv_events.seq,
        "block_hashes": [h.hex() for h in engine.pool.cached_hashes()],
    }
