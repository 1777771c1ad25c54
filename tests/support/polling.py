"""Deadline polling for tests: wait until a condition holds, fail with what was last seen if it never does.

A test that needs something to have happened (a span exported, a process gone, a request paused) polls
for it with :func:`wait_until` (or :func:`async_wait_until` on an event loop) instead of sleeping a fixed
time: it goes on as soon as the condition holds, and a timeout is a failure that says what was awaited.
Importable because ``tests/conftest.py`` puts this folder on ``sys.path``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def _timed_out(what: str, timeout_s: float, value: object) -> AssertionError:
    return AssertionError(f"timed out after {timeout_s:g} s waiting for {what} (last: {value!r})")


def wait_until(
    condition: Callable[[], T], timeout_s: float = 10.0, what: str = "the condition", interval_s: float = 0.01
) -> T:
    """Poll ``condition()`` until it is truthy and return that value; AssertionError at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout_s, value)
        time.sleep(interval_s)
    return value


async def async_wait_until(
    condition: Callable[[], T],
    timeout_s: float = 10.0,
    what: str = "the condition",
    interval_s: float = 0.005,
) -> T:
    """:func:`wait_until` on an event loop: the loop keeps running between polls."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout_s, value)
        await asyncio.sleep(interval_s)
    return value


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
