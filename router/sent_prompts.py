"""Prompts this router sent to one replica, counted as cached there before the replica's ``/kv/events``
can say so: from the moment they are sent (the engine caches blocks as it computes them; a request that
follows waits behind that work anyway) until an events poll sent after they finished has been applied
(which then reports their blocks, or their eviction).

Kept as lazy block chains grouped by their first block's hash, not as hash sets: a prompt's chain is only
hashed as far as a later request with the same first block compares it, so a unique tail is never hashed
and the sender pays nothing on its routing path.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvpilot.router.block_chain import BlockChain


class SentPrompts:
    def __init__(self) -> None:
        self._in_flight: dict[bytes, list[BlockChain]] = {}
        #: first hash → (finish time, chain) of prompts that finished after their first byte
        self._finished: dict[bytes, list[tuple[float, BlockChain]]] = {}

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
                    self._finished.setdefault(first, []).append((now, chain))

    def confirmed(self, sent_at: float) -> None:
        """An events poll sent at ``sent_at`` was applied: the index covers what finished before it."""
        for first in list(self._finished):
            kept = [(t, c) for t, c in self._finished[first] if t >= sent_at]
            if kept:
                self._finished[first] = kept
            else:
                del self._finished[first]

    def holds(self, index: int, block_hash: bytes, first: bytes) -> bool:
        """Whether a sent prompt starting with block ``first`` has ``block_hash`` as its block ``index``."""
        for chain in self._in_flight.get(first, ()):
            if index < chain.full_blocks and chain.hash_at(index) == block_hash:
                return True
        return any(
            index < chain.full_blocks and chain.hash_at(index) == block_hash
            for _, chain in self._finished.get(first, ())
        )

    def __len__(self) -> int:
        return sum(map(len, self._in_flight.values())) + sum(map(len, self._finished.values()))
