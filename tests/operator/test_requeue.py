"""The reconcile queue: one pass at a time per InferenceService, bursts of triggers folded, follow-ups
kept to the earliest, failures retried."""

from __future__ import annotations

import asyncio

from polling import async_wait_until

from kvpilot.operator.requeue import Key, Requeue

A, B = ("ml", "a"), ("ml", "b")


class Recorder:
    """A reconcile that records its calls and, while ``gate`` is clear, blocks (a pass in progress)."""

    def __init__(self) -> None:
        self.calls: list[Key] = []
        self.running: dict[Key, int] = {}
        self.most_at_once: dict[Key, int] = {}
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_next = 0

    async def __call__(self, key: Key) -> None:
        self.calls.append(key)
        self.running[key] = self.running.get(key, 0) + 1
        self.most_at_once[key] = max(self.most_at_once.get(key, 0), self.running[key])
        try:
            await self.gate.wait()
            if self.fail_next:
                self.fail_next -= 1
                raise RuntimeError("the API server went away")
        finally:
            self.running[key] -= 1


async def test_triggers_during_a_pass_fold_into_one_more_and_passes_never_overlap():
    recorder = Recorder()
    queue = Requeue(recorder)
    recorder.gate.clear()
    queue.trigger(A)
    await async_wait_until(lambda: recorder.calls == [A], what="the first pass running")
    for _ in range(20):  # a rollout's burst of pod events
        queue.trigger(A)
    queue.trigger(B)
    await async_wait_until(lambda: B in recorder.calls, what="another service's pass, not held up by A")
    recorder.gate.set()
    await async_wait_until(lambda: queue.pending == 0, what="the queue drained")
    assert recorder.calls.count(A) == 2 and recorder.calls.count(B) == 1
    assert recorder.most_at_once == {A: 1, B: 1}


async def test_a_trigger_before_a_queued_pass_starts_adds_nothing():
    recorder = Recorder()
    queue = Requeue(recorder)
    for _ in range(5):
        queue.trigger(A)
    await async_wait_until(lambda: queue.pending == 0, what="the queue drained")
    assert recorder.calls == [A]


async def test_follow_ups_keep_the_earliest_and_can_be_forgotten():
    recorder = Recorder()
    queue = Requeue(recorder)
    queue.trigger(A, delay=60)
    queue.trigger(A, delay=0.05)  # earlier: replaces the 60 s one
    queue.trigger(A, delay=30)  # later than the pending one: ignored
    await async_wait_until(lambda: recorder.calls == [A], timeout_s=5, what="the 0.05 s follow-up")
    # the pass is recorded when it starts; the follow-up leaves the queue when the pass returns
    await async_wait_until(lambda: queue.pending == 0, what="the queue drained")
    queue.trigger(B, delay=0.05)
    queue.forget(B)  # deleted meanwhile: its follow-up is cancelled, nothing left to run
    assert queue.pending == 0 and recorder.calls == [A]


async def test_a_failed_pass_is_retried_after_the_retry_delay():
    recorder = Recorder()
    recorder.fail_next = 1
    queue = Requeue(recorder, retry_delay=0.05)
    queue.trigger(A)
    await async_wait_until(lambda: len(recorder.calls) == 2, timeout_s=5, what="the retry")
    await async_wait_until(lambda: queue.pending == 0, what="the queue drained")
    assert recorder.calls == [A, A]
