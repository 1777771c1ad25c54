"""An engine's ``GET /load`` answer as a typed, validated snapshot (docs/engine-router-contract.md).

A replica whose ``/load`` breaks the contract is treated as failed: routing on numbers it cannot trust is
worse than not routing to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


class LoadFormatError(ValueError):
    """The ``/load`` body lacks a field or has one of the wrong type."""


@dataclass(frozen=True)
class EngineLoad:
    ready: bool
    phase: str
    #: changes when the engine restarts (the prefix cache starts empty again)
    epoch: str
    waiting: int
    running: int
    #: prompt tokens still to compute: waiting requests' uncached tokens + running prefill remainders
    queued_prefill_tokens: int
    #: one per decoding request
    running_decode_tokens: int
    kv_blocks_total: int
    #: free + cached-free blocks (allocatable now)
    kv_blocks_free: int
    #: blocks promised to queued requests
    kv_blocks_reserved: int
    block_size: int
    max_num_seqs: int
    #: the engine's EMA of prefill throughput (0 before any prefill)
    prefill_tokens_per_second: float
    #: the engine's EMA of a decode-only step's wall time (0 before any)
    decode_step_seconds: float
    #: the engine's context limit in tokens (0: not reported, e.g. an older engine)
    max_model_len: int = 0

    @classmethod
    def from_json(cls, body: Any) -> EngineLoad:
        if not isinstance(body, dict):
            raise LoadFormatError(f"/load must be a JSON object, got {type(body).__name__}")
        ready = body.get("ready")
        if not isinstance(ready, bool):
            raise LoadFormatError(f"/load field 'ready' must be a boolean, got {ready!r}")
        return cls(
            ready=ready,
            phase=_string(body, "phase"),
            epoch=_string(body, "epoch"),
            waiting=_count(body, "waiting"),
            running=_count(body, "running"),
            queued_prefill_tokens=_count(body, "queued_prefill_tokens"),
            running_decode_tokens=_count(body, "running_decode_tokens"),
            kv_blocks_total=_count(body, "kv_blocks_total"),
            kv_blocks_free=_count(body, "kv_blocks_free"),
            kv_blocks_reserved=_count(body, "kv_blocks_reserved"),
            block_size=_count(body, "block_size", minimum=1),
            max_num_seqs=_count(body, "max_num_seqs", minimum=1),
            prefill_tokens_per_second=_rate(body, "prefill_tokens_per_second"),
            decode_step_seconds=_rate(body, "decode_step_seconds"),
            max_model_len=_count(body, "max_model_len") if "max_model_len" in body else 0,
        )

    @property
    def kv_headroom_blocks(self) -> int:
        """Blocks a new request can still get: allocatable now minus what queued requests were promised."""
        return self.kv_blocks_free - self.kv_blocks_reserved


def _string(body: dict, name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str):
        raise LoadFormatError(f"/load field {name!r} must be a string, got {value!r}")
    return value


def _count(body: dict, name: str, minimum: int = 0) -> int:
    value = body.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LoadFormatError(f"/load field {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _rate(body: dict, name: str) -> float:
    value = body.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise LoadFormatError(f"/load field {name!r} must be a finite number >= 0, got {value!r}")
    return float(value)
