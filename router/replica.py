"""What one router knows about one engine replica: readiness, its last ``/load``, its cached block hashes,
its learned prefill rate, and the requests this router has in flight there.

Staleness is the classic failure of load-aware routers: between two polls every router sees the same old
numbers and herds onto the replica that looked idle. So the snapshot handed to scoring adds this router's
requests that the last ``/load`` cannot include yet (sent after that poll was sent): their prefill tokens,
their count, their KV blocks; and the prompts this router sent count as cached there before the events say
so (``sent_prompts``), so a burst of one prefix follows its first request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.router.block_chain import BlockChain
from kvpilot.router.engine_load import EngineLoad
from kvpilot.router.prefill_rate import PrefillRateEstimator
from kvpilot.router.prefix_index import PrefixIndex
from kvpilot.router.request_profile import RequestProfile
from kvpilot.router.scoring import ReplicaSnapshot
from kvpilot.router.sent_prompts import SentPrompts


@dataclass(eq=False)
class Dispatch:
    """One request this router sent to a replica, from send to the end of its response."""

    sent_at: float
    #: prefill work estimated ahead of and in the request (queued + uncached tokens), for rate learning
    prefill_work_tokens: int
    uncached_tokens: int
    kv_blocks: int
    #: the request's prompts as block chains under this replica's root (empty if the root is unknown)
    chains: tuple[BlockChain, ...] = ()
    first_byte_at: float | None = None
    #: the replica's answer was a success (2xx): its prefill ran there (an engine's 4xx/5xx computed none)
    computed: bool = False


class Replica:
    def __init__(self, url: str, zone: str | None = None, pod: str | None = None) -> None:
        self.url = url
        self.zone = zone
        self.pod = pod  # the pod's name, where discovery knows it (error messages name it, not the address)
        self.load: EngineLoad | None = None
        #: when the poll that produced :attr:`load` was sent (requests sent later are not in it)
        self.load_sent_at = -math.inf
        self.index = PrefixIndex()
        self.rate = PrefillRateEstimator()
        self.in_flight: set[Dispatch] = set()
        self.sent = SentPrompts()
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

    def kv_applied(self, sent_at: float) -> None:
        """The index now reflects the engine as of a poll sent at ``sent_at``."""
        self.sent.confirmed(sent_at)

    def chains(self, profile: RequestProfile) -> tuple[BlockChain, ...]:
        """The request's block chains under this replica's hash root (none while the root is unknown)."""
        root, block_size = self.index.root, self.index.block_size
        if root is None or block_size is None:
            return ()
        return tuple(profile.chains(root, block_size))

    def cached_tokens(self, profile: RequestProfile) -> int:
        """Prompt tokens of ``profile`` a request sent here now would find cached (exact chain matches)."""
        block_size = self.index.block_size or 0
        return sum(self._cached_blocks(chain) * block_size for chain in self.chains(profile))

    def _cached_blocks(self, chain: BlockChain) -> int:
        if chain.hittable_blocks == 0:
            return 0
        cached = self.index.hashes if self.index.synced else frozenset()
        first = chain.hash_at(0)
        return chain.cached_blocks(
            cached, lambda index, block_hash: self.sent.holds(index, block_hash, first)
        )

    def snapshot(self, prefill_rate: float) -> ReplicaSnapshot:
        """Scoring's view, including this router's requests the last ``/load`` cannot include yet; its work
        is costed at ``prefill_rate`` (the picker chooses: the fleet's or this replica's own)."""
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
            prefill_tokens_per_second=prefill_rate,
            kv_headroom_blocks=load.kv_headroom_blocks - sum(d.kv_blocks for d in unreported),
        )

    def begin(self, dispatch: Dispatch) -> None:
        self.in_flight.add(dispatch)
        self.sent.add(dispatch.chains)

    def first_byte(self, dispatch: Dispatch, now: float, status: int) -> None:
        """The answer's first byte came, with HTTP ``status``; only a success measured a prefill."""
        dispatch.first_byte_at = now
        dispatch.computed = 200 <= status < 300
        if dispatch.computed:
            self.rate.observe(dispatch.prefill_work_tokens, now - dispatch.sent_at)

    def finish(self, dispatch: Dispatch, now: float) -> None:
        if dispatch not in self.in_flight:
            return
        self.in_flight.discard(dispatch)
        # A successful answer means its prefill ran there: its blocks are cached until a poll says otherwise.
        self.sent.finish(dispatch.chains, now, computed=dispatch.computed)
