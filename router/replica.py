"""What one router knows about one engine replica: readiness, its last ``/load``, its cached block hashes,
its learned prefill rate, and the requests this router has in flight there.

Staleness is the classic failure of load-aware routers: between two polls every router sees the same old
numbers and herds onto the replica that looked idle. So the snapshot handed to scoring adds this router's
requests that the last ``/load`` cannot include yet (sent after that poll was sent): their prefill tokens,
their count, their KV blocks; and a request's block hashes count as held by its replica from the moment it
is sent (the engine caches them as it computes them), and after it ends until a ``/kv/events`` poll sent
later has been applied (which then reports them, or their eviction), so a burst of one prefix follows the
first request without a gap.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from kvpilot.router.engine_load import EngineLoad
from kvpilot.router.prefill_rate import PrefillRateEstimator
from kvpilot.router.prefix_index import PrefixIndex
from kvpilot.router.request_profile import RequestProfile
from kvpilot.router.scoring import ReplicaSnapshot


@dataclass(eq=False)
class Dispatch:
    """One request this router sent to a replica, from send to the end of its response."""

    sent_at: float
    #: prefill work estimated ahead of and in the request (queued + uncached tokens), for rate learning
    prefill_work_tokens: int
    uncached_tokens: int
    kv_blocks: int
    #: block hashes counted as held by the replica while this request is in flight
    block_hashes: set[bytes] = field(default_factory=set)
    first_byte_at: float | None = None


class Replica:
    def __init__(self, url: str, zone: str | None = None) -> None:
        self.url = url
        self.zone = zone
        self.load: EngineLoad | None = None
        #: when the poll that produced :attr:`load` was sent (requests sent later are not in it)
        self.load_sent_at = -math.inf
        self.index = PrefixIndex()
        self.rate = PrefillRateEstimator()
        self.in_flight: set[Dispatch] = set()
        self._pending: Counter[bytes] = Counter()
        #: hashes of finished requests → when they finished, until a later events poll confirms them
        self._recent: dict[bytes, float] = {}
        self.ejected_at: float | None = None
        self.eject_reason: str | None = None

    @property
    def routable(self) -> bool:
        return self.load is not None and self.load.ready and self.ejected_at is None

    def eject(self, reason: str, now: float) -> bool:
        """Stop routing here until a poll sent after ``now`` finds it ready; True if it was routable."""
        was_routable = self.routable
        self.ejected_at = now
        self.eject_reason = reason
        return was_routable

    def accept_load(self, load: EngineLoad, sent_at: float) -> None:
        if self.load is not None and load.epoch != self.load.epoch:
            # A restarted engine: an empty cache and new speed figures.
            self.rate.reset()
            self.index.invalidate()
        self.load = load
        self.load_sent_at = sent_at
        self.rate.report_engine(load.prefill_tokens_per_second)
        if self.ejected_at is not None and sent_at > self.ejected_at and load.ready:
            self.ejected_at = None
            self.eject_reason = None

    def holds(self, block_hash: bytes) -> bool:
        return (block_hash in self._pending or block_hash in self._recent
                or (self.index.synced and block_hash in self.index.hashes))

    def kv_applied(self, sent_at: float) -> None:
        """The index now reflects the engine as of a poll sent at ``sent_at``: drop what it now covers."""
        if self._recent:
            self._recent = {h: t for h, t in self._recent.items() if t >= sent_at}

    def cached_tokens(self, profile: RequestProfile) -> int:
        """Prompt tokens of ``profile`` a request sent here now would find cached (exact chain matches)."""
        root, block_size = self.index.root, self.index.block_size
        if root is None or block_size is None:
            return 0
        return sum(chain.cached_blocks(self.holds) * block_size for chain in profile.chains(root, block_size))

    def block_hashes(self, profile: RequestProfile, complete: bool) -> list[bytes]:
        """The request's full-block hashes under this replica's chain root: all of them (``complete``), or
        only those already computed (empty while the root is unknown)."""
        root, block_size = self.index.root, self.index.block_size
        if root is None or block_size is None:
            return []
        chains = profile.chains(root, block_size)
        return [h for chain in chains for h in (chain.all_hashes() if complete else chain.computed_hashes())]

    def snapshot(self, fallback_rate: float) -> ReplicaSnapshot:
        """Scoring's view, including this router's requests the last ``/load`` cannot include yet."""
        load = self.load
        if load is None:
            raise RuntimeError(f"{self.url} has not reported its load yet")
        unreported = [d for d in self.in_flight if d.sent_at > self.load_sent_at]
        prefilling = sum(d.uncached_tokens for d in unreported if d.first_byte_at is None)
        decoding = sum(1 for d in unreported if d.first_byte_at is not None)
        return ReplicaSnapshot(
            key=self.url,
            block_size=load.block_size,
            queued_prefill_tokens=load.queued_prefill_tokens + prefilling,
            outstanding_requests=load.waiting + load.running + len(unreported),
            running_decodes=load.running_decode_tokens + decoding,
            decode_step_seconds=load.decode_step_seconds,
            prefill_tokens_per_second=self.rate.rate() or fallback_rate,
            kv_headroom_blocks=load.kv_headroom_blocks - sum(d.kv_blocks for d in unreported),
        )

    def begin(self, dispatch: Dispatch) -> None:
        self.in_flight.add(dispatch)
        self._pending.update(dispatch.block_hashes)

    def hold(self, dispatch: Dispatch, block_hashes: list[bytes]) -> None:
        """Count more of ``dispatch``'s blocks as held here (the router hashes a prompt's unique tail only
        after the request is on its way, off the routing path)."""
        if dispatch not in self.in_flight:
            return
        new = set(block_hashes) - dispatch.block_hashes
        dispatch.block_hashes |= new
        self._pending.update(new)

    def first_byte(self, dispatch: Dispatch, now: float) -> None:
        dispatch.first_byte_at = now
        self.rate.observe(dispatch.prefill_work_tokens, now - dispatch.sent_at)

    def finish(self, dispatch: Dispatch, now: float) -> None:
        if dispatch not in self.in_flight:
            return
        self.in_flight.discard(dispatch)
        if dispatch.first_byte_at is not None:  # it was computed there: cached until a poll says otherwise
            self._recent.update(dict.fromkeys(dispatch.block_hashes, now))
        self._pending.subtract(dispatch.block_hashes)
        for block_hash in dispatch.block_hashes:
            if self._pending[block_hash] <= 0:
                del self._pending[block_hash]
