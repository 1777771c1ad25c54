"""A tensor-parallel engine whose worker dies or hangs fails cleanly and leaves no process behind
(docs/architecture.md#tensor-parallelism): a SIGKILLed rank is reported by ``check_health`` within a
bounded time and every later step raises ``TensorParallelError`` naming it; a stopped one fails the step
at the collective timeout; a clean shutdown stops the workers with exit code 0. (The server loop's side —
live requests FAILED, unhealthy — is tests/server/test_engine_loop.py's.)"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
from polling import process_alive, wait_until

from kvpilot.engine.distributed.executor import TensorParallelError
from kvpilot.engine.engine_args import EngineArgs
from kvpilot.engine.engine_core import LLMEngine
from kvpilot.engine.sampling.params import SamplingParams

#: a dead rank must be noticed well within this (the watchdog wakes on the process sentinel)
DETECT_S = 10.0
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def tp2_engine() -> LLMEngine:
    return LLMEngine(
        EngineArgs(
            model="tiny-random", device="cpu", num_kv_blocks=32, tensor_parallel_size=2
        ).create_config()
    )


def finish(engine: LLMEngine, rid: str) -> None:
    engine.add_request(rid, [5, 6, 7], GREEDY)
    while engine.has_unfinished_requests():
        engine.step()


def test_a_killed_worker_fails_the_engine_and_no_process_remains(tiny_model_dir):
    engine = tp2_engine()
    try:
        finish(engine, "before")
        (pid,) = engine.tp_workers.pids
        os.kill(pid, signal.SIGKILL)

        def reported() -> str | None:
            try:
                engine.check_health()
            except TensorParallelError as err:
                return str(err)
            return None

        reason = wait_until(reported, DETECT_S, "check_health to report the dead rank")
        assert reason == f"tensor-parallel worker kvpilot-tp-rank-1 (pid {pid}) exited with code -9"
        engine.add_request("after", [5, 6, 7], GREEDY)
        with pytest.raises(TensorParallelError, match="exited with code -9"):
            engine.step()
    finally:
        engine.shutdown()
    assert not process_alive(pid) and multiprocessing.active_children() == []


@pytest.mark.slow
def test_a_step_right_after_the_kill_raises_instead_of_hanging(tiny_model_dir):
    """The step may start before the watchdog has seen the death: the broadcast or the all-reduce with
    the dead peer fails then, within the bound, and the error names a failed collective or the rank."""
    engine = tp2_engine()
    try:
        engine.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
        engine.step()
        (pid,) = engine.tp_workers.pids
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TensorParallelError):
            for _ in range(50):
                engine.step()
        assert time.monotonic() - start < DETECT_S
    finally:
        engine.shutdown()
    assert not process_alive(pid) and multiprocessing.active_children() == []


def test_a_hung_worker_fails_the_step_at_the_collective_timeout(tiny_model_dir, monkeypatch):
    """A stopped (SIGSTOP) worker is alive but never joins the all-reduce: the step raises once the
    collective's timeout (3 s here, 60 s by default) passes, instead of hanging; shutdown kills it."""
    from kvpilot.engine.distributed import executor

    monkeypatch.setattr(executor, "COLLECTIVE_TIMEOUT_S", 3.0)
    engine = tp2_engine()
    try:
        finish(engine, "before")
        (pid,) = engine.tp_workers.pids
        os.kill(pid, signal.SIGSTOP)
        engine.add_request("after", [5, 6, 7], GREEDY)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="a collective failed"):
            engine.step()
        assert 3.0 <= time.monotonic() - start < DETECT_S
        with pytest.raises(TensorParallelError, match="a collective failed"):
            engine.check_health()
    finally:
        engine.shutdown()
    assert not process_alive(pid) and multiprocessing.active_children() == []


def test_shutdown_stops_the_workers_cleanly_and_is_idempotent(tiny_model_dir):
    engine = tp2_engine()
    finish(engine, "r")
    procs = list(engine.tp_workers.processes)
    engine.shutdown()
    engine.shutdown()
    assert [p.exitcode for p in procs] == [0]
    assert multiprocessing.active_children() == []
