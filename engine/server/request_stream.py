"""One request's bounded hand-off from the engine thread to its HTTP handler on the event loop.

The engine thread ``put``s output chunks, each with its size in bytes (an upper bound of the JSON it
becomes); the handler ``get``s them when its client is ready for more (a streaming response pulls the next
chunk only after the previous one was written). When ``capacity`` chunks or ``capacity_bytes`` bytes pile
up, ``put`` says so once and the engine loop backpressures the request (it keeps its KV blocks but gets no
decode steps, state BACKPRESSURED); when the handler has drained the buffer to ``resume_depth`` chunks and
half its bytes, ``get`` calls ``on_drained`` once and the engine loop resumes it. So a slow client holds at
most ``capacity`` chunks and ``capacity_bytes`` bytes + (one engine step's chunk) in memory, however long
its generation (docs/architecture.md#backpressure-and-cancellation).

The deque is guarded by a lock (two threads); the asyncio event is only touched on the event loop, woken
through ``call_soon_threadsafe`` and only when the handler is actually waiting (the engine loop wakes a
whole step's handlers in one such call, ``wake_all``).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

#: handlers' events to set, by event loop (``RequestStream.put``, then ``wake_all``)
Wakes = dict[asyncio.AbstractEventLoop, list[asyncio.Event]]


class RequestStream:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        capacity: int,
        resume_depth: int,
        on_drained: Callable[[], None],
        capacity_bytes: int | None = None,
    ) -> None:
        """``capacity_bytes`` None: chunks are counted, their sizes not."""
        if not 0 <= resume_depth < capacity:
            raise ValueError(f"need 0 <= resume_depth < capacity, got {resume_depth}, {capacity}")
        if capacity_bytes is not None and capacity_bytes < 1:
            raise ValueError(f"need capacity_bytes >= 1, got {capacity_bytes}")
        self._loop = loop
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        self.resume_depth = resume_depth
        self._resume_bytes = capacity_bytes // 2 if capacity_bytes is not None else None
        self._on_drained = on_drained
        self._items: deque[tuple[Any, int]] = deque()
        self._bytes = 0
        self._lock = threading.Lock()
        self._event = asyncio.Event()
        self._consumer_waiting = False
        self._backpressured = False

    # ---- engine thread -----------------------------------------------------------------------------
    def put(self, item: Any, nbytes: int = 0, wakes: Wakes | None = None) -> bool:
        """Append ``item`` of ``nbytes``; True exactly when this put filled the buffer (the caller pauses
        the request). With ``wakes``, a waiting handler's event is added there for the caller to set with
        ``wake_all`` (one thread hop for a whole step's chunks) instead of being woken now."""
        with self._lock:
            self._items.append((item, nbytes))
            self._bytes += nbytes
            full = len(self._items) >= self.capacity or (
                self.capacity_bytes is not None and self._bytes >= self.capacity_bytes
            )
            pause = full and not self._backpressured
            if pause:
                self._backpressured = True
            wake, self._consumer_waiting = self._consumer_waiting, False
        if wake:
            if wakes is None:
                self._loop.call_soon_threadsafe(self._event.set)
            else:
                wakes.setdefault(self._loop, []).append(self._event)
        return pause

    # ---- event loop ----------------------------------------------------------------------------------
    async def get(self) -> Any:
        while True:
            with self._lock:
                if self._items:
                    item = self._pop()
                    resume = (
                        self._backpressured
                        and len(self._items) <= self.resume_depth
                        and (self._resume_bytes is None or self._bytes <= self._resume_bytes)
                    )
                    if resume:
                        self._backpressured = False
                    break
                self._consumer_waiting = True
                self._event.clear()
            await self._event.wait()
        if resume:
            self._on_drained()
        return item

    def take_nowait(self) -> Any | None:
        """The next item if one is buffered, else None (for a handler that is giving up on the request)."""
        with self._lock:
            return self._pop() if self._items else None

    def _pop(self) -> Any:
        item, nbytes = self._items.popleft()
        self._bytes -= nbytes
        return item

    @property
    def depth(self) -> int:
        with self._lock:
            return len(self._items)

    @property
    def nbytes(self) -> int:
        """The bytes buffered (as ``put`` counted them)."""
        with self._lock:
            return self._bytes

    @property
    def backpressured(self) -> bool:
        with self._lock:
            return self._backpressured


def wake_all(wakes: Wakes) -> None:
    """From the engine thread: set the events ``RequestStream.put`` collected, one ``call_soon_threadsafe``
    per event loop: each call writes to the loop's wake-up pipe, a system call per request per step
    otherwise."""
    for loop, events in wakes.items():
        loop.call_soon_threadsafe(_set_each, events)


def _set_each(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()
