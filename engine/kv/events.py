"""An ordered, epoch-stamped log of prefix-cache changes (``/kv/events``, read by the router).

Every block hash that becomes cached is a ``stored`` event, every eviction a ``removed`` event, a cache
reset a ``cleared`` event. Events carry a gap-free sequence number; the log keeps the last ``capacity``
events. A reader that asks for events since a sequence number the log no longer holds, or that saw
another ``epoch`` (a restarted engine), must resync from a full snapshot.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class KVEvent:
    seq: int
    kind: str  # "stored" | "removed" | "cleared"
    hashes: tuple[str, ...]

    def to_json(self) -> dict:
        return {"seq": self.seq, "type": self.kind, "block_hashes": list(self.hashes)}


@dataclass(frozen=True)
class EventBatch:
    epoch: str
    #: sequence number of the newest event in the log (0 when none yet)
    seq: int
    events: list[KVEvent]
    #: True when events after the reader's ``since`` were dropped: the reader must resync
    gap: bool


class KVEventLog:
    """Thread-safe: the engine loop appends, server threads read."""

    def __init__(self, capacity: int = 65536) -> None:
        self.epoch = uuid.uuid4().hex
        self._events: deque[KVEvent] = deque(maxlen=capacity)
        self._seq = 0
        self._lock = threading.Lock()

    def _append(self, kind: str, hashes: list[bytes]) -> None:
        with self._lock:
            self._seq += 1
            self._events.append(KVEvent(self._seq, kind, tuple(h.hex() for h in hashes)))

    def stored(self, hashes: list[bytes]) -> None:
        if hashes:
            self._append("stored", hashes)

    def removed(self, hashes: list[bytes]) -> None:
        if hashes:
            self._append("removed", hashes)

    def cleared(self) -> None:
        self._append("cleared", [])

    @property
    def seq(self) -> int:
        return self._seq

    def since(self, seq: int) -> EventBatch:
        """Events with sequence number > ``seq``."""
        with self._lock:
            events = [e for e in self._events if e.seq > seq] if seq < self._seq else []
            oldest = self._events[0].seq if self._events else self._seq + 1
            gap = seq < oldest - 1 or seq > self._seq
            return EventBatch(self.epoch, self._seq, [] if gap else events, gap)
