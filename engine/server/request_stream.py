"""One request's bounded hand-off from the engine thread to its HTTP handler on the event loop.

The engine thread ``put``s output chunks; the handler ``get``s them when its client is ready for more
(a streaming response pulls the next chunk only after the previous one was written to the socket). When
``capacity`` chunks pile up, ``put`` says so once and the engine loop backpressures the request (it keeps
its KV blocks but gets no decode steps, state BACKPRESSURED); when the handler has drained the buffer to
``resume_depth``, ``get`` calls ``on_drained`` once and the engine loop resumes it. So a slow client holds
at most ``capacity`` + (one engine step) chunks in memory, however long its generation.

The deque is guarded by a lock (two threads); the asyncio event is only touched on the event loop, woken
through ``call_soon_threadsafe`` and only when the handler is actually waiting.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from typing import Any


class RequestStream:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        capacity: int,
        resume_depth: int,
        on_drained: Callable[[], None],
    ) -> None:
        if not 0 <= resume_depth < capacity:
            raise ValueError(f"need 0 <= resume_depth < capacity, got {resume_depth}, {capacity}")
        self._loop = loop
        self.capacity = capacity
        self.resume_depth = resume_depth
        self._on_drained = on_drained
        self._items: deque[Any] = deque()
        self._lock = threading.Lock()
        self._event = asyncio.Event()
        self._consumer_waiting = False
        self._backpressured = False

    # ---- engine thread -----------------------------------------------------------------------------
    def put(self, item: Any) -> bool:
        """Append ``item``; True exactly when this put filled the buffer (the caller pauses the request)."""
        with self._lock:
            self._items.append(item)
            pause = len(self._items) >= self.capacity and not self._backpressured
            if pause:
                self._backpressured = True
            wake, self._consumer_waiting = self._consumer_waiting, False
        if wake:
            self._loop.call_soon_threadsafe(self._event.set)
        return pause

    # ---- event loop ----------------------------------------------------------------------------------
    async def get(self) -> Any:
        while True:
            with self._lock:
                if self._items:
                    item = self._items.popleft()
                    resume = self._backpressured and len(self._items) <= self.resume_depth
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
            return self._items.popleft() if self._items else None

    @property
    def depth(self) -> int:
        with self._lock:
            return len(self._items)

    @property
    def backpressured(self) -> bool:
        with self._lock:
            return self._backpressured
