"""The per-replica cached-hash set: applies events exactly, refuses anything it cannot apply exactly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.router.prefix_index import KVFormatError, PrefixIndex

ROOT = "9a" * 16
H = [bytes([i]) * 16 for i in range(8)]


def snapshot(seq: int = 2, hashes: list[bytes] = H[:2], epoch: str = "e1") -> dict:
    return {
        "epoch": epoch,
        "seq": seq,
        "block_size": 16,
        "root": ROOT,
        "block_hashes": [h.hex() for h in hashes],
    }


def events(
    *items: tuple[int, str, list[bytes]], seq: int | None = None, gap: bool = False, epoch: str = "e1"
) -> dict:
    newest = seq if seq is not None else (items[-1][0] if items else 2)
    return {
        "epoch": epoch,
        "seq": newest,
        "gap": gap,
        "block_size": 16,
        "root": ROOT,
        "events": [
            {"seq": s, "type": kind, "block_hashes": [h.hex() for h in hashes]} for s, kind, hashes in items
        ],
    }


def synced() -> PrefixIndex:
    index = PrefixIndex()
    index.apply_snapshot(snapshot())
    return index


def test_snapshot_then_ordered_events():
    index = synced()
    assert (index.synced, index.seq, index.hashes, index.root, index.block_size) == (
        True,
        2,
        {H[0], H[1]},
        bytes.fromhex(ROOT),
        16,
    )
    assert index.apply_events(events((3, "stored", [H[2], H[3]]), (4, "removed", [H[0]])))
    assert (index.seq, index.hashes) == (4, {H[1], H[2], H[3]})
    assert index.apply_events(events(seq=4))  # nothing new
    assert index.apply_events(events((5, "cleared", []), (6, "stored", [H[5]])))
    assert (index.seq, index.hashes) == (6, {H[5]})


@pytest.mark.parametrize(
    "body",
    [
        events((3, "stored", [H[2]]), gap=True),  # the engine dropped events we had not read
        events((3, "stored", [H[2]]), epoch="e2"),  # the engine restarted
        events((4, "stored", [H[2]])),  # a hole in the sequence
        events((3, "stored", [H[2]]), seq=5),  # claims newer events than it sent
        events(seq=1),  # older than what we hold
        {**events((3, "stored", [H[2]])), "root": "00" * 16},  # another model's chain
    ],
)
def test_anything_not_exactly_applicable_asks_for_a_resync(body):
    index = synced()
    assert index.apply_events(body) is False
    assert (index.synced, index.hashes) == (False, set())
    assert index.apply_events(events((3, "stored", [H[2]]))) is False  # stays unsynced until a snapshot


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"seq": 3},
        {**events(), "seq": -1},
        {**events(), "gap": "no"},
        {**events(), "root": "xyz"},
        events((3, "evicted", [H[2]])),
        {**events(), "events": [{"seq": 3, "type": "stored", "block_hashes": "ab"}]},
    ],
)
def test_malformed_bodies_raise_and_leave_the_index_unsynced(body):
    index = synced()
    with pytest.raises(KVFormatError):
        index.apply_events(body)
    assert not index.synced and index.hashes == set()


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["stored", "removed", "cleared"]), st.lists(st.sampled_from(H), max_size=4)
        ),
        max_size=30,
    ),
    st.integers(1, 5),
)
def test_events_in_any_batching_give_the_engines_set(changes, batch):
    # What the engine holds after each change, and an index fed the same changes in batches of `batch`.
    truth: set[bytes] = set()
    numbered = []
    for seq, (kind, hashes) in enumerate(changes, start=3):
        hashes = [] if kind == "cleared" else hashes
        truth = (
            set() if kind == "cleared" else (truth | set(hashes) if kind == "stored" else truth - set(hashes))
        )
        numbered.append((seq, kind, hashes))
    index = PrefixIndex()
    index.apply_snapshot(snapshot(hashes=[]))
    for start in range(0, len(numbered), batch):
        assert index.apply_events(events(*numbered[start : start + batch]))
    assert index.hashes == truth
