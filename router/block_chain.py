"""One prompt's prefix-cache block hashes, computed lazily with the engine's own hash function.

The chain property makes laziness exact: a replica that lacks block i cannot serve blocks after it (the
engine's lookup stops at the first miss), so measuring a replica's hit needs hashes only up to its first
miss, and a prompt's unique tail is hashed only when the router records the blocks it just sent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet

from kvpilot.engine.kv.block_hash import hash_block_bytes, token_bytes
from kvpilot.router.generations import Generations

#: blocks per memoized run of a chain: one lookup covers this many blocks of a shared prefix
GROUP = 8
_RUN = b"run"
# (parent, token bytes, extra keys), plus _RUN for a run's entry
_Key = tuple[bytes, ...]


class HashMemo:
    """Recently computed block hashes by (parent, block's token bytes, extra keys), and whole runs of
    :data:`GROUP` blocks by (parent, the run's token bytes, extra keys): a shared system prompt's chain is
    hashed once, not once per request, and found again in one lookup per run."""

    def __init__(self, max_entries: int = 1 << 18) -> None:
        self._entries: Generations[_Key, bytes | tuple[bytes, ...]] = Generations(max_entries)

    def __len__(self) -> int:
        return len(self._entries)

    def hash_block(self, parent: bytes, block_token_bytes: bytes, extra: bytes) -> bytes:
        key = (parent, block_token_bytes, extra)
        block_hash = self._entries.young.get(key) or self._entries.get(key)
        if block_hash is None:
            block_hash = hash_block_bytes(parent, block_token_bytes, extra)
            self._entries.put(key, block_hash)
        assert isinstance(block_hash, bytes)
        return block_hash

    def run(self, parent: bytes, run_token_bytes: bytes, extra: bytes) -> tuple[bytes, ...] | None:
        key = (parent, run_token_bytes, extra, _RUN)
        found = self._entries.young.get(key) or self._entries.get(key)
        assert found is None or isinstance(found, tuple)
        return found

    def remember_run(
        self, parent: bytes, run_token_bytes: bytes, extra: bytes, hashes: tuple[bytes, ...]
    ) -> None:
        # Tagged: a run of 8 blocks of 16 tokens has the bytes of one block of 128 (another block size).
        self._entries.put((parent, run_token_bytes, extra, _RUN), hashes)


class BlockChain:
    def __init__(
        self,
        token_ids: Sequence[int],
        block_size: int,
        root: bytes,
        extra: bytes,
        memo: HashMemo | None = None,
    ) -> None:
        self._tokens = token_ids
        self._bytes: bytes | None = None  # every token's hash encoding, made on the first hash
        self.block_size = block_size
        self._root = root
        self._extra = extra
        self._memo = memo
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
            self._bytes = token_bytes(self._tokens[: self.full_blocks * self.block_size])
        data, step, extra, memo = self._bytes, 4 * self.block_size, self._extra, self._memo
        while len(hashes) <= index:
            done = len(hashes)
            parent = hashes[-1] if hashes else self._root
            if memo is not None and done % GROUP == 0 and done + GROUP <= self.full_blocks:
                run = memo.run(parent, data[done * step : (done + GROUP) * step], extra)
                if run is not None:
                    hashes.extend(run)
                    continue
            hashes.append(self._hash_block(parent, data[done * step : (done + 1) * step], extra))
            if memo is not None and len(hashes) % GROUP == 0:
                start = len(hashes) - GROUP
                memo.remember_run(
                    hashes[start - 1] if start else self._root,
                    data[start * step : len(hashes) * step],
                    extra,
                    tuple(hashes[start:]),
                )
        return hashes[index]

    def hashes(self, limit: int) -> list[bytes]:
        """Hashes of blocks 0 … ``limit`` - 1 (``limit`` ≤ :attr:`full_blocks`)."""
        if limit:
            self.hash_at(limit - 1)
        return self._hashes[:limit]

    def leading_hashes(self, limit: int, start: int = 0) -> Iterator[bytes]:
        """Hashes of blocks ``start``, ``start`` + 1, … below ``limit`` (≤ :attr:`full_blocks`), computed only
        as far as the caller iterates."""
        for index in range(start, limit):
            yield self.hash_at(index)

    def cached_blocks(
        self, cached: AbstractSet[bytes], also_held: Callable[[int, bytes], bool] | None = None
    ) -> int:
        """Leading blocks held, as the engine's prefix lookup counts a hit: each block's hash is in ``cached``
        or ``also_held(index, hash)`` says so."""
        limit = self.hittable_blocks
        count = 0
        # Held runs a set test at a time, hashed only as far as the first run with a miss: a prompt's new tail
        # is not hashed here unless the replica holds what comes before it, and a replica that lacks the
        # first block (every replica, for a new prefix) costs one hash.
        hashes = self._hashes
        if limit and self.hash_at(0) in cached:
            while count < limit:
                end = min(count + GROUP, limit)
                self.hash_at(end - 1)
                if not cached.issuperset(hashes[count:end]):
                    break
                count = end
        for block_hash in self.leading_hashes(limit, start=count):
            if block_hash not in cached and (also_held is None or not also_held(count, block_hash)):
                break
            count += 1
        return count

    def all_hashes(self) -> list[bytes]:
        return self.hashes(self.full_blocks)
