"""One prompt's prefix-cache block hashes, computed lazily with the engine's own hash function.

The chain property makes laziness exact: a replica that lacks block i cannot serve blocks after it (the
engine's lookup stops at the first miss), so measuring a replica's hit needs hashes only up to its first
miss, and a prompt's unique tail is hashed only when the router records the blocks it just sent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet

from kvpilot.engine.kv.block_hash import hash_block_bytes, token_bytes


class BlockChain:
    def __init__(self, token_ids: Sequence[int], block_size: int, root: bytes, extra: bytes) -> None:
        self._tokens = token_ids
        self._bytes: bytes | None = None  # every token's hash encoding, made on the first hash
        self.block_size = block_size
        self._root = root
        self._extra = extra
        self._hashes: list[bytes] = []
        #: full blocks of the prompt (the engine caches each once it is computed)
        self.full_blocks = len(token_ids) // block_size
        #: blocks a cache hit can cover: the engine always computes the last prompt token itself
        self.hittable_blocks = (len(token_ids) - 1) // block_size if token_ids else 0

    def hash_at(self, index: int) -> bytes:
        """Hash of block ``index`` (< :attr:`full_blocks`), computing the chain up to it once."""
        hashes = self._hashes
        if index < len(hashes):
            return hashes[index]
        if self._bytes is None:
            self._bytes = token_bytes(self._tokens[: self.full_blocks * self.block_size])
        step = 4 * self.block_size  # four bytes per token id
        while len(hashes) <= index:
            done = len(hashes)
            parent = hashes[-1] if hashes else self._root
            hashes.append(hash_block_bytes(parent, self._bytes[done * step : (done + 1) * step], self._extra))
        return hashes[index]

    def leading_hashes(self, limit: int) -> Iterator[bytes]:
        """Hashes of blocks 0, 1, … below ``limit`` (≤ :attr:`full_blocks`), computed only as far as the
        caller iterates."""
        for index in range(limit):
            yield self.hash_at(index)

    def cached_blocks(
        self, cached: AbstractSet[bytes], also_held: Callable[[int, bytes], bool] | None = None
    ) -> int:
        """Leading blocks held, as the engine's prefix lookup counts a hit: each block's hash is in ``cached``
        or ``also_held(index, hash)`` says so. Hashed only up to the first block that is not held."""
        count = 0
        for block_hash in self.leading_hashes(self.hittable_blocks):
            if block_hash not in cached and (also_held is None or not also_held(count, block_hash)):
                break
            count += 1
        return count

    def all_hashes(self) -> list[bytes]:
        if self.full_blocks:
            self.hash_at(self.full_blocks - 1)
        return self._hashes[: self.full_blocks]
