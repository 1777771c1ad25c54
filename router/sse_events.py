"""Cuts an upstream SSE stream after its last complete event, so the proxy relays whole events and a replica
that dies mid-event leaves nothing half-written before the router's error event.

Each byte is looked at once (an event's end may straddle two chunks: the last two bytes seen are kept),
and the unfinished event is held only up to ``limit`` bytes: the engine's own events can be far longer
(``prompt_logprobs`` of a long prompt is one event of megabytes), so a longer one is passed on as it
comes, and the stream is :attr:`EventSplitter.torn` until that event ends. A replica that fails while it
is torn leaves the client a broken connection instead of an error event glued to half an event.
"""

from __future__ import annotations

#: what ends an SSE event (a blank line, in any of the spec's line endings)
EVENT_ENDS = (b"\n\n", b"\r\r", b"\n\r\n")
#: bytes of an unfinished event held back at most (per stream); longer events are passed on unheld
HELD_EVENT_BYTES = 1 << 20


class EventSplitter:
    def __init__(self, limit: int = HELD_EVENT_BYTES) -> None:
        self._limit = limit
        self._held = bytearray()  # the unfinished event, not passed on yet
        self._tail = b""  # the last two bytes seen
        #: part of an unfinished event has been passed on
        self.torn = False

    def feed(self, chunk: bytes) -> bytes:
        """What to relay now: everything up to the last event end seen (or, torn, everything)."""
        if not self._held and chunk.endswith(EVENT_ENDS):  # the engine writes whole events: the usual case
            self._tail, self.torn = chunk[-2:], False
            return chunk
        window = self._tail + chunk
        end = 0
        for ending in EVENT_ENDS:
            at = window.rfind(ending)
            if at >= 0:
                end = max(end, at + len(ending))
        end -= len(self._tail)
        self._tail = window[-2:]
        if end > 0:  # an event ended in this chunk
            out = bytes(self._held) + chunk[:end]
            self._held = bytearray(chunk[end:])
            self.torn = False
        elif self.torn:
            return chunk
        else:
            out = b""
            self._held += chunk
        if len(self._held) > self._limit:
            out += self._held
            self._held = bytearray()
            self.torn = True
        return out

    def rest(self) -> bytes:
        """The unfinished event held at the end of the stream (the replica ended its body there)."""
        rest, self._held = bytes(self._held), bytearray()
        return rest
