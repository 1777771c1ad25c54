"""A bounded cache of two generations, for the router's hot lookups (block hashes, token pieces), with an
optional pinned tier for entries known before serving (a vocabulary's words).

Why not an LRU list: an ``OrderedDict`` pays a ``move_to_end`` on every hit. Here a hit in the young
generation is one dict probe; a hit in the old one moves the entry back to the young one; when the young
generation fills it becomes the old one and the previous old one is dropped, so an entry survives at least
one whole generation after its last use and the cache never holds more than ``max_entries``.

Why pinned entries stay out of the young generation until used: the young dict is the hot path's working
set. Filled with a whole vocabulary (32k words for SmolLM2) the ~250 words a prompt actually uses lie
scattered over a megabyte of dict and objects, and on a core whose caches an engine's matmuls just evicted
each lookup is several memory misses; promoted one by one as requests use them they sit together.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Generations(Generic[K, V]):
    def __init__(self, max_entries: int) -> None:
        #: the current generation; callers on a hot path may probe it directly before calling :meth:`get`
        self.young: dict[K, V] = {}
        self._old: dict[K, V] = {}
        #: entries kept for good, outside the bound (see the module docstring); a hit also puts one in young
        self.pinned: dict[K, V] = {}
        self._generation = max(1, max_entries // 2)

    def __len__(self) -> int:
        """Entries in the two generations (the bounded part; pinned ones count once promoted)."""
        return len(self.young) + len(self._old)

    def get(self, key: K) -> V | None:
        found = self.young.get(key)
        if found is None:
            found = self._old.get(key)
            if found is None:
                found = self.pinned.get(key)
            if found is not None:
                self.put(key, found)
        return found

    def put(self, key: K, value: V) -> None:
        self.young[key] = value
        if len(self.young) >= self._generation:
            self._old, self.young = self.young, {}

    def pin(self, key: K, value: V) -> None:
        """Keep ``key`` for good; it joins the young generation when first looked up."""
        self.pinned[key] = value
