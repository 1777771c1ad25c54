"""A bounded cache of two generations, for the router's hot lookups (block hashes, token pieces).

Why not an LRU list: an ``OrderedDict`` pays a ``move_to_end`` on every hit. Here a hit in the young
generation is one dict probe; a hit in the old one moves the entry back to the young one; when the young
generation fills it becomes the old one and the previous old one is dropped, so an entry survives at least
one whole generation after its last use and the cache never holds more than ``max_entries``.
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
        self._generation = max(1, max_entries // 2)

    def __len__(self) -> int:
        return len(self.young) + len(self._old)

    def get(self, key: K) -> V | None:
        found = self.young.get(key)
        if found is None:
            found = self._old.get(key)
            if found is not None:
                self.put(key, found)
        return found

    def put(self, key: K, value: V) -> None:
        self.young[key] = value
        if len(self.young) >= self._generation:
            self._old, self.young = self.young, {}
