"""Engine counters and the ``/load`` snapshot (docs/engine-router-contract.md).

The engine loop updates ``EngineStats`` after every step; readers on other threads only read published
immutable snapshots, never the live scheduler state.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpilot.engine.engine_core import LLMEngine

_EMA = 0.2  # weight of the newest step in the moving averages


@dataclass
class EngineStats:
    #: prompt tokens computed (cache hits excluded) / generated tokens committed to sequences
    prompt_tokens: int = 0
    generation_tokens: int = 0
    #: prefix-cache lookups at first scheduling, in tokens queried / tokens found cached
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    steps: int = 0
    #: terminal records by finish reason
    finished: Counter = field(default_factory=Counter)
    #: moving averages: prompt tokens computed per second of step time, wall time of decode-only steps
    prefill_tokens_per_second: float = 0.0
    decode_step_seconds: float = 0.0
    #: time spent in steps that carried prefill tokens / decode-only steps (for metrics)
    last_step_seconds: float = 0.0
    last_step_prefill_tokens: int = 0
    last_step_decode_tokens: int = 0
    #: speculative decoding (vLLM's accounting): verifications of a draft, draft tokens scored, drafts
    #: accepted, and accepted drafts by position in the draft (index 0 = the first draft token)
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    #: verifications by the tokens they emitted (accepted drafts + 1)
    spec_acceptance_lengths: Counter = field(default_factory=Counter)

    def record_verification(self, num_draft: int, num_accepted: int) -> None:
        self.spec_num_drafts += 1
        self.spec_draft_tokens += num_draft
        self.spec_accepted_tokens += num_accepted
        self.spec_acceptance_lengths[num_accepted + 1] += 1
        per_pos = self.spec_accepted_per_position
        if len(per_pos) < num_draft:
            per_pos.extend([0] * (num_draft - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1

    def record_step(self, seconds: float, prefill_tokens: int, decode_tokens: int) -> None:
        self.steps += 1
        self.last_step_seconds = seconds
        self.last_step_prefill_tokens = prefill_tokens
        self.last_step_decode_tokens = decode_tokens
        if prefill_tokens and seconds > 0:
            rate = prefill_tokens / seconds
            self.prefill_tokens_per_second = (
                rate
                if not self.prefill_tokens_per_second
                else (1 - _EMA) * self.prefill_tokens_per_second + _EMA * rate
            )
        elif decode_tokens:
            self.decode_step_seconds = (
                seconds
                if not self.decode_step_seconds
                else (1 - _EMA) * self.decode_step_seconds + _EMA * seconds
            )


def load_snapshot(engine: LLMEngine) -> dict:
    """The ``/load`` body (minus server-owned fields such as readiness): queue depths, work in tokens,
    KV blocks, and the engine's measured speeds."""
    sched, pool, kv = engine.scheduler, engine.pool, engine.kv
    queued_prefill = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
    queued_prefill += sum(
        r.num_prompt_tokens - r.num_computed_tokens
        for r in sched.running
        if r.num_computed_tokens < r.num_prompt_tokens
    )
    running_decode = sum(1 for r in sched.running if r.num_computed_tokens >= r.num_prompt_tokens)
    total = pool.num_usable
    return {
        "model": engine.served_model_name,
        "epoch": engine.kv_events.epoch,
        "waiting": len(sched.waiting),
        "running": len(sched.running),
        "swapped": len(sched.swapped),
        "queued_prefill_tokens": queued_prefill,
        "running_decode_tokens": running_decode,
        "kv_blocks_total": total,
        "kv_blocks_free": pool.num_free,
        "kv_blocks_cached": pool.num_cached,
        "kv_blocks_reserved": kv.num_reserved_blocks,
        "kv_usage": 1 - pool.num_free / total,
        "block_size": kv.block_size,
        "max_model_len": engine.max_model_len,
        "kv_cache_bytes": engine.kv_cache.total_bytes,
        "kv_cache_sizing": engine.kv_cache_sizing,
        # what the cache stores: auto (activations' dtype), fp8 or int8 (docs/architecture.md#kv-cache-dtype)
        "kv_cache_dtype": engine.kv_cache.kv_cache_dtype,
        # what the weights are kept as and the activations' dtype (docs/architecture.md#quantized-weights)
        "quantization": engine.quantization,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "max_num_seqs": engine.config.scheduler.max_num_seqs,
        "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
        "prefill_tokens_per_second": engine.stats.prefill_tokens_per_second,
        "decode_step_seconds": engine.stats.decode_step_seconds,
    }
