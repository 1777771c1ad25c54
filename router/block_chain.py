"""One prompt's prefix-cache block hashes, computed lazily with the engine's own hash function.

The chain property makes laziness exact: a replica that lacks block i cannot serve blocks after it (the
engine's lookup stops at the first miss), so measuring a replica's hit needs hashes only up to its first
miss, and a prompt's unique tail is hashed only when the router records the blocks it just sent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from kvpilot.engine.kv.block_hash import hash_block_bytes, token_bytes


class HashMemo:
    """Recently computed block hashes by (parent, block's token bytes, extra keys): a shared system prompt's
    chain is hashed once, not once per request (a lookup costs a tenth of a hash).

    Two generations instead of an LRU list keep a lookup to one or two dict probes: a block unused for a
    whole generation is dropped when the next generation fills."""

    def __init__(self, max_blocks: int = 1 << 18) -> None:
        self._young: dict[tuple[bytes, bytes, bytes], bytes] = {}
        self._old: dict[tuple[bytes, bytes, bytes], bytes] = {}
        self._generation = max(1, max_blocks // 2)

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def hash_block(self, parent: bytes, block_token_bytes: bytes, extra: bytes) -> bytes:
        key = (parent, block_token_bytes, extra)
        block_hash = self._young.get(key)
        if block_hash is not None:
            return block_hash
        block_hash = self._old.get(key)
        if block_hash is None:
            block_hash = hash_block_bytes(parent, block_token_bytes, extra)
        self._young[key] = block_hash
        if len(self._young) >= self._generation:
            self._old, self._young = self._young, {}
        return block_hash


class BlockChain:
    def __init__(self, token_ids: Sequence[int], block_size: int, root: bytes, extra: bytes,
                 memo: HashMemo | None = None) -> None:
        self._tokens = token_ids
        self._bytes: bytes | None = None  # every token's hash encoding, made on the first hash
        self.block_size = block_size
        self._root = root
        self._extra = extra
        self._hash_block = memo.hash_block if memo is not None else hash_block_bytes
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
            self._bytes = token_bytes(self._tokens[:self.full_blocks * self.block_size])
        data, step, extra, hash_block = self._bytes, 4 * self.block_size, self._extra, self._hash_block
        parent = hashes[-1] if hashes else self._root
        for start in range(len(hashes) * step, (index + 1) * step, step):
            parent = hash_block(parent, data[start:start + step], extra)
            hashes.append(parent)
        return parent

    def leading_hashes(self, limit: int) -> Iterator[bytes]:
        """Hashes of blocks 0, 1, … below ``limit`` (≤ :attr:`full_blocks`), computed only as far as the
        caller iterates."""
        hashes = self._hashes
        for index in range(limit):
            yield hashes[index] if index < len(hashes) else self.hash_at(index)

    def cached_blocks(self, held: Callable[[bytes], bool]) -> int:
        """Leading blocks for which ``held(hash)`` is true, as the engine's prefix lookup counts a hit."""
        count = 0
        for block_hash in self.leading_hashes(self.hittable_blocks):
            if not held(block_hash):
                break
            count += 1
        return count

    def all_hashes(self) -> list[bytes]:
        if self.full_blocks:
            self.hash_at(self.full_blocks - 1)
        return list(self._hashes[:self.full_blocks])
