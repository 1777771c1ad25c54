"""Replica choice, as pure functions of what the router knows (no I/O, no clocks): unit-testable exactly.

The cache-aware policy minimises the estimated completion cost, not the hit rate (a replica holding the
whole prefix but with a deep queue can be slower than an idle one without it):

    cost(r) = (w_queue × Q_r + w_prefill × U_r) / P_r + w_decode × S_r

- Q_r: prefill tokens already queued at r (engine-reported, plus this router's requests the last report
  cannot include yet), U_r: this request's prompt tokens r does not hold (exact, from r's block hashes),
  P_r: r's learned prefill rate (tokens/s), S_r: r's decode-step seconds when it has decodes running
  (the first token waits for a step of that batch; 0 when idle).
- Candidates: routable replicas with KV headroom (free − reserved blocks ≥ blocks this request would
  take); if none has headroom, the one with the most headroom ("fallback").
- Hot-spot guard (bounded-load consistent hashing): a replica whose outstanding requests reach
  max(floor, ceil((1 + balance) × (total + 1) / n)) is passed over while another is below, so one very
  popular prefix spreads to a second replica instead of queueing on one.
- Ties (costs within ``tie_ms`` of the best) go to the highest rendezvous weight of (first-block key,
  replica), so independent routers with the same view agree, and a new prefix sticks to one replica.
- Reasons: ``affinity`` (the winner holds the longest cached prefix, > 0), ``load`` (another replica held
  more of it, but load or headroom ruled it out), ``cold`` (no replica holds any of it), ``fallback``.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvpilot.router.config import ScoringWeights

AFFINITY, LOAD, COLD, FALLBACK = "affinity", "load", "cold", "fallback"
REASONS = (AFFINITY, LOAD, COLD, FALLBACK)


# Immutable records as NamedTuples, not frozen dataclasses: one routing decision builds eight of them, and a
# frozen dataclass's __init__ (an object.__setattr__ per field) costs several times a tuple's.


class ReplicaSnapshot(NamedTuple):
    """One routable replica as scoring sees it."""

    key: str  # its base URL: the same string in every router, so rendezvous weights agree
    block_size: int
    queued_prefill_tokens: int
    outstanding_requests: int  # waiting + running at the engine, plus this router's unreported ones
    running_decodes: int
    decode_step_seconds: float
    prefill_tokens_per_second: float  # > 0
    kv_headroom_blocks: int


class Candidate(NamedTuple):
    replica: ReplicaSnapshot
    cached_tokens: int  # of this request's prompt tokens, already limited to what a hit can cover


class RequestShape(NamedTuple):
    prompt_tokens: int
    max_output_tokens: int
    tie_key: bytes


class Decision(NamedTuple):
    key: str
    reason: str
    #: expected time to first token there (unweighted physics of the cost); None when not estimated
    estimated_ttft_s: float | None = None
    cached_tokens: int = 0
    uncached_tokens: int = 0
    #: prefill tokens queued there plus this request's uncached ones (what the first token waits for)
    prefill_work_tokens: int = 0
    #: KV blocks the request will take there
    kv_blocks: int = 0


@functools.lru_cache(maxsize=1 << 14)  # a tenant's requests share their tie key: its weights repeat
def rendezvous_weight(tie_key: bytes, replica_key: str) -> int:
    digest = hashlib.blake2b(tie_key + b"\x00" + replica_key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def uncached_tokens(candidate: Candidate, request: RequestShape) -> int:
    return request.prompt_tokens - candidate.cached_tokens


def needed_blocks(candidate: Candidate, request: RequestShape) -> int:
    """KV blocks the request would take there: its uncached prompt tokens plus its output budget."""
    tokens = uncached_tokens(candidate, request) + request.max_output_tokens
    return math.ceil(tokens / candidate.replica.block_size)


def decode_seconds(replica: ReplicaSnapshot) -> float:
    return replica.decode_step_seconds if replica.running_decodes > 0 else 0.0


def estimated_ttft(candidate: Candidate, request: RequestShape) -> float:
    replica = candidate.replica
    work = replica.queued_prefill_tokens + uncached_tokens(candidate, request)
    return work / replica.prefill_tokens_per_second + decode_seconds(replica)


def cost(candidate: Candidate, request: RequestShape, weights: ScoringWeights) -> float:
    replica = candidate.replica
    work = weights.queue * replica.queued_prefill_tokens + weights.prefill * uncached_tokens(
        candidate, request
    )
    return work / replica.prefill_tokens_per_second + weights.decode * decode_seconds(replica)


def hot_spot_cap(candidates: Sequence[Candidate], weights: ScoringWeights) -> int:
    """Outstanding requests at which a replica counts as a hot spot (bounded-load hashing's capacity)."""
    total = sum(c.replica.outstanding_requests for c in candidates)
    bounded = math.ceil((1 + weights.balance) * (total + 1) / len(candidates))
    return max(bounded, math.ceil(weights.balance_floor))


def choose_cache_aware(
    request: RequestShape, candidates: Sequence[Candidate], weights: ScoringWeights
) -> Decision:
    if not candidates:
        raise ValueError("no candidate replicas")
    with_room = [c for c in candidates if c.replica.kv_headroom_blocks >= needed_blocks(c, request)]
    if not with_room:
        best = _highest(candidates, request.tie_key, lambda c: c.replica.kv_headroom_blocks)
        return _decision(best, FALLBACK, request)
    cap = hot_spot_cap(with_room, weights)
    eligible = [c for c in with_room if c.replica.outstanding_requests < cap] or with_room
    costs = {c.replica.key: cost(c, request, weights) for c in eligible}
    lowest = min(costs.values())
    tied = [c for c in eligible if costs[c.replica.key] <= lowest + weights.tie_ms / 1000.0]
    best = _highest(tied, request.tie_key, lambda c: 0)
    longest = max(c.cached_tokens for c in candidates)
    if longest == 0:
        reason = COLD
    elif best.cached_tokens == longest:
        reason = AFFINITY
    else:
        reason = LOAD
    return _decision(best, reason, request)


def choose_least_loaded(candidates: Sequence[Candidate], rotation: int) -> Decision:
    """Fewest outstanding requests; ties rotate (a cache-blind baseline: no hash decides)."""
    if not candidates:
        raise ValueError("no candidate replicas")
    fewest = min(c.replica.outstanding_requests for c in candidates)
    tied = sorted(
        (c for c in candidates if c.replica.outstanding_requests == fewest), key=lambda c: c.replica.key
    )
    return Decision(tied[rotation % len(tied)].replica.key, LOAD)


def choose_round_robin(keys: Sequence[str], rotation: int) -> Decision:
    """The next replica in key order: uses no information, so its decisions count as ``fallback``."""
    if not keys:
        raise ValueError("no candidate replicas")
    ordered = sorted(keys)
    return Decision(ordered[rotation % len(ordered)], FALLBACK)


def _highest(
    candidates: Sequence[Candidate], tie_key: bytes, primary: Callable[[Candidate], float]
) -> Candidate:
    return max(candidates, key=lambda c: (primary(c), rendezvous_weight(tie_key, c.replica.key)))


def _decision(candidate: Candidate, reason: str, request: RequestShape) -> Decision:
    uncached = uncached_tokens(candidate, request)
    return Decision(
        candidate.replica.key,
        reason,
        estimated_ttft(candidate, request),
        candidate.cached_tokens,
        uncached,
        candidate.replica.queued_prefill_tokens + uncached,
        needed_blocks(candidate, request),
    )
