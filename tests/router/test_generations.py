"""The two-generation cache: an entry lives at least one whole generation after its last use, a hit in the
old generation brings the entry back, and the cache never holds more than its bound."""

from __future__ import annotations

from kvpilot.router.generations import Generations


def test_entries_survive_a_generation_and_old_hits_come_back():
    cache: Generations[str, int] = Generations(max_entries=4)  # generations of 2
    cache.put("a", 1)
    cache.put("b", 2)  # the young generation is full: a, b become the old one
    assert (cache.young, len(cache)) == ({}, 2)
    assert cache.get("a") == 1 and cache.young == {"a": 1}  # brought back
    cache.put("c", 3)  # young {a, c} full: old becomes {a, c}, b is dropped
    assert (cache.get("b"), cache.get("c"), cache.get("missing")) == (None, 3, None)
    for n in range(100):
        cache.put(f"k{n}", n)
        assert len(cache) <= 4


def test_pinned_entries_outlive_generations_and_join_the_young_one_when_used():
    cache: Generations[str, int] = Generations(max_entries=8)  # generations of 4
    cache.pin("the", 7)
    assert (cache.young, len(cache), cache.young.get("the")) == ({}, 0, None)  # not in the hot dict yet
    assert cache.get("the") == 7 and cache.young == {"the": 7}
    for n in range(9):
        cache.put(f"k{n}", n)  # "the" ages out of both generations ...
    assert "the" not in cache.young and "the" not in cache._old and list(cache.young) == ["k7", "k8"]
    assert cache.get("the") == 7 and cache.young["the"] == 7  # ... and is still found, promoted again
    assert cache.pinned == {"the": 7}
