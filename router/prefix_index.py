"""The exact set of prefix-cache block hashes one replica holds, kept current from its ``/kv/events``.

The engine numbers its cache changes without gaps inside one ``epoch``; this index applies them in order
and refuses anything it cannot apply exactly (a gap, a new epoch, a malformed body), after which the owner
must resync from ``/kv/snapshot``. Until then :attr:`synced` is False and the router ignores this
replica's cache: a stale set would send requests after blocks that are gone.
"""

from __future__ import annotations

from typing import Any


class KVFormatError(ValueError):
    """A ``/kv/events`` or ``/kv/snapshot`` body breaks the contract."""


class PrefixIndex:
    def __init__(self) -> None:
        self.hashes: set[bytes] = set()
        self.epoch: str | None = None
        #: sequence number of the newest change applied
        self.seq = 0
        #: ``h_{-1}`` of the replica's hash chain (from the events/snapshot ``root``)
        self.root: bytes | None = None
        self.block_size: int | None = None
        self.synced = False

    def invalidate(self) -> None:
        """Forget everything; the next poll must load a snapshot."""
        self.hashes = set()
        self.synced = False

    def apply_snapshot(self, body: Any) -> None:
        """Replace the set with a ``/kv/snapshot`` body (raises :class:`KVFormatError`, leaving it
        unsynced)."""
        self.invalidate()
        epoch, seq, root, block_size = _header(body, "/kv/snapshot")
        hashes = _hashes(body, "/kv/snapshot")
        self.hashes, self.epoch, self.seq, self.root, self.block_size = (
            set(hashes),
            epoch,
            seq,
            root,
            block_size,
        )
        self.synced = True

    def apply_events(self, body: Any) -> bool:
        """Apply a ``/kv/events?since=<self.seq>`` body; False (and unsynced) when a resync is needed."""
        if not self.synced:
            return False
        try:
            return self._apply_batch(body)
        except KVFormatError:
            self.invalidate()  # a half-applied batch is not the replica's set
            raise

    def _apply_batch(self, body: Any) -> bool:
        epoch, seq, root, block_size = _header(body, "/kv/events")
        gap = body.get("gap")
        if not isinstance(gap, bool):
            raise KVFormatError(f"/kv/events field 'gap' must be a boolean, got {gap!r}")
        if gap or epoch != self.epoch or root != self.root or block_size != self.block_size or seq < self.seq:
            self.invalidate()
            return False
        events = body.get("events")
        if not isinstance(events, list):
            raise KVFormatError("/kv/events field 'events' must be a list")
        expected = self.seq + 1
        for event in events:
            if not isinstance(event, dict) or event.get("seq") != expected:
                # Events must continue our sequence exactly; anything else means we missed some.
                self.invalidate()
                return False
            self._apply(event)
            expected += 1
        if expected - 1 != seq:
            self.invalidate()
            return False
        self.seq = seq
        return True

    def _apply(self, event: dict) -> None:
        kind = event.get("type")
        hashes = _hashes(event, "/kv/events event")
        if kind == "stored":
            self.hashes.update(hashes)
        elif kind == "removed":
            self.hashes.difference_update(hashes)
        elif kind == "cleared":
            self.hashes.clear()
        else:
            raise KVFormatError(f"/kv/events event type must be stored, removed or cleared, got {kind!r}")


def _header(body: Any, what: str) -> tuple[str, int, bytes, int]:
    if not isinstance(body, dict):
        raise KVFormatError(f"{what} must be a JSON object")
    epoch, seq, root, block_size = (
        body.get("epoch"),
        body.get("seq"),
        body.get("root"),
        body.get("block_size"),
    )
    if not isinstance(epoch, str) or not epoch:
        raise KVFormatError(f"{what} field 'epoch' must be a non-empty string, got {epoch!r}")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise KVFormatError(f"{what} field 'seq' must be an integer >= 0, got {seq!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise KVFormatError(f"{what} field 'block_size' must be a positive integer, got {block_size!r}")
    return epoch, seq, _hex(root, f"{what} field 'root'"), block_size


def _hashes(body: dict, what: str) -> list[bytes]:
    values = body.get("block_hashes")
    if not isinstance(values, list):
        raise KVFormatError(f"{what} field 'block_hashes' must be a list")
    return [_hex(value, f"{what} block hash") for value in values]


def _hex(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise KVFormatError(f"{what} must be a hex string, got {value!r}")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise KVFormatError(f"{what} is not hex: {value[:40]!r}") from None
