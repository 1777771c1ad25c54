"""One prompt's prefix-cache block hashes, computed lazily with the engine's own hash function.

The chain property makes laziness exact: a replica that lacks block i cannot serve blocks after it (the
engine's lookup stops at the first miss), so measuring a replica's hit needs hashes only up to its first
miss, and a prompt's unique tail is hashed only when the router records the blocks it just sent.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvpilot.engine.kv.block_hash import hash_block


class HashMemo:
    """Recently computed block hashes by (parent, tokens, extra keys): a shared system prompt's chain is
    hashed once, not once per request (a lookup costs about a quarter of a hash)."""

    def __init__(self, max_blocks: int = 1 << 18) -> None:
        self._hashes: OrderedDict[tuple[bytes, tuple[int, ...], bytes], bytes] = OrderedDict()
        self._max_blocks = max_blocks

    def hash_block(self, parent: bytes, tokens: Sequence[int], extra: bytes) -> bytes:
        key = (parent, tuple(tokens), extra)
        block_hash = self._hashes.get(key)
        if block_hash is None:
            block_hash = self._hashes[key] = hash_block(parent, tokens, extra)
            if len(self._hashes) > self._max_blocks:
                self._hashes.popitem(last=False)
        else:
            self._hashes.move_to_end(key)
        return block_hash


class BlockChain:
    def __init__(self, token_ids: Sequence[int], block_size: int, root: bytes, extra: bytes,
                 memo: HashMemo | None = None) -> None:
        self._tokens = token_ids
        self.block_size = block_size
        self._root = root
        self._extra = extra
        self._hash_block = memo.hash_block if memo is not None else hash_block
        self._hashes: list[bytes] = []
        #: full blocks of the prompt (the engine caches each once it is computed)
        self.full_blocks = len(token_ids) // block_size
        #: blocks a cache hit can cover: the engine always computes the last prompt token itself
        self.hittable_blocks = (len(token_ids) - 1) // block_size if token_ids else 0

    def hash_at(self, index: int) -> bytes:
        """Hash of block ``index`` (< :attr:`full_blocks`), computing the chain up to it once."""
        hashes = self._hashes
        while len(hashes) <= index:
            start = len(hashes) * self.block_size
            parent = hashes[-1] if hashes else self._root
            hashes.append(self._hash_block(parent, self._tokens[start:start + self.block_size], self._extra))
        return hashes[index]

    def cached_blocks(self, held: Callable[[bytes], bool]) -> int:
        """Leading blocks for which ``held(hash)`` is true, as the engine's prefix lookup counts a hit."""
        count = 0
        while count < self.hittable_blocks and held(self.hash_at(count)):
            count += 1
        return count

    def all_hashes(self) -> list[bytes]:
        if self.full_blocks:
            self.hash_at(self.full_blocks - 1)
        return list(self._hashes[:self.full_blocks])
