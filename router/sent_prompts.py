"""Prompts this router sent to one replica, counted as cached there before the replica's ``/kv/events``
can say so: from the moment they are sent (the engine caches blocks as it computes them; a request that
follows waits behind that work anyway) until an events poll sent after they finished has been applied
(which then reports their blocks, or their eviction).

Kept as lazy block chains grouped by their first block's hash, not as hash sets: a prompt's chain is only
hashed as far as a later request with the same first block compares it, so a unique tail is never hashed
and the sender pays nothing on its routing path.

Finished prompts wait for a poll that may never come (a replica whose ``/kv/*`` fails), so they are held
within bounds: at most :data:`MAX_HELD_CHAINS` chains and :data:`MAX_HELD_TOKENS` tokens, each for at most
:data:`MAX_HELD_AGE_S`; the oldest go first, the ones the next poll would have confirmed anyway.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from kvpilot.router.block_chain import BlockChain

#: finished prompts held per replica (a poll interval's worth normally: the default poll is every 0.1 s)
MAX_HELD_CHAINS = 1024
#: their full-block tokens (a chain keeps its ids and their hash bytes: about 8 bytes a token)
MAX_HELD_TOKENS = 1 << 18
#: seconds a finished prompt counts as cached without a poll confirming it
MAX_HELD_AGE_S = 30.0


class SentPrompts:
    def __init__(self) -> None:
        self._in_flight: dict[bytes, list[BlockChain]] = {}
        #: first hash → chains of prompts that finished after their first byte, oldest first
        self._finished: dict[bytes, deque[BlockChain]] = {}
        #: (finish time, first hash, chain) of every finished chain, oldest first
        self._order: deque[tuple[float, bytes, BlockChain]] = deque()
        self._tokens = 0  # full-block tokens of the finished chains

    def add(self, chains: Iterable[BlockChain]) -> None:
        for chain in chains:
            if chain.full_blocks:
                self._in_flight.setdefault(chain.hash_at(0), []).append(chain)

    def finish(self, chains: Iterable[BlockChain], now: float, computed: bool) -> None:
        """The request ended; if its prefill ran (``computed``), its blocks stay held until confirmed."""
        for chain in chains:
            if not chain.full_blocks:
                continue
            first = chain.hash_at(0)
            group = self._in_flight.get(first, [])
            if any(c is chain for c in group):
                group[:] = [c for c in group if c is not chain]
                if not group:
                    del self._in_flight[first]
                if computed:
                    self._finished.setdefault(first, deque()).append(chain)
                    self._order.append((now, first, chain))
                    self._tokens += _tokens(chain)
        order = self._order
        while order and (
            len(order) > MAX_HELD_CHAINS
            or (self._tokens > MAX_HELD_TOKENS and len(order) > 1)
            or order[0][0] < now - MAX_HELD_AGE_S
        ):
            self._drop_oldest()

    def confirmed(self, sent_at: float) -> None:
        """An events poll sent at ``sent_at`` was applied: the index covers what finished before it."""
        while self._order and self._order[0][0] < sent_at:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, first, chain = self._order.popleft()
        group = self._finished[first]
        group.popleft()  # the same chain: both are in finishing order
        if not group:
            del self._finished[first]
        self._tokens -= _tokens(chain)

    def holds(self, index: int, block_hash: bytes, first: bytes) -> bool:
        """Whether a sent prompt starting with block ``first`` has ``block_hash`` as its block ``index``."""
        for chain in self._in_flight.get(first, ()):
            if index < chain.full_blocks and chain.hash_at(index) == block_hash:
                return True
        return any(
            index < chain.full_blocks and chain.hash_at(index) == block_hash
            for chain in self._finished.get(first, ())
        )

    def __len__(self) -> int:
        return sum(map(len, self._in_flight.values())) + len(self._order)


def _tokens(chain: BlockChain) -> int:
    return chain.full_blocks * chain.block_size
