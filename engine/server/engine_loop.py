"""The engine loop: the one thread that touches the engine (``LLMEngine`` is not thread-safe).

It loads the engine (phase loading), warms it up (warming_up), then serves (ready) by repeating:

    commands (submit / abort / resume / kv snapshot / drain / stop; blocks only when idle)
    → queue deadlines → pending admissions → one engine step → outputs into request streams
    → publish the /load snapshot

HTTP handlers talk to it only through commands (a thread-safe queue) and read back immutable things:
the published ``/load`` dict (replaced, never mutated), ``EngineInfo``, and each request's stream.
An abort (client gone, queue deadline) reclaims the request's blocks in the engine at once, and the
snapshot published right after shows it. An exception from the engine is fatal: every open request
gets a 500 and is reclaimed as FAILED (its blocks freed, one terminal record), the phase becomes failed,
``on_fatal`` stops the server so the pod restarts.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpilot.engine.sequence import SequenceStatus
from kvpilot.engine.server.admission import Admission, draining_error
from kvpilot.engine.server.config import ServerConfig, WarmupBucket
from kvpilot.engine.server.engine_info import EngineInfo
from kvpilot.engine.server.engine_telemetry import EngineTelemetry
from kvpilot.engine.server.errors import APIError
from kvpilot.engine.server.lifecycle import Lifecycle, Phase
from kvpilot.engine.server.loop_commands import (
    Abort,
    Drain,
    KVSnapshot,
    Resume,
    Stop,
    Submit,
    kv_snapshot,
)
from kvpilot.engine.server.metrics import ServerMetrics
from kvpilot.engine.server.output_deltas import max_json_bytes
from kvpilot.engine.server.request_stream import Wakes, wake_all
from kvpilot.engine.server.serving_request import ServingRequest
from kvpilot.engine.server.warmup import effective_buckets, run_warmup
from kvpilot.engine.stats import load_snapshot

if TYPE_CHECKING:  # torch: the engine is imported on the engine thread (app.py)
    from kvpilot.engine.engine_core import LLMEngine

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.25  # longest sleep with nothing to do (bounds heartbeat age and /load staleness)
QUEUED_WAIT_S = 0.02  # sleep while requests wait for headroom (bounds queue-deadline lateness)


class EngineLoop:
    def __init__(
        self,
        engine_factory: Callable[[], LLMEngine],
        config: ServerConfig,
        lifecycle: Lifecycle,
        metrics: ServerMetrics,
        initial_load: dict,
        on_fatal: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self._engine_factory = engine_factory
        self._config = config
        self._lifecycle = lifecycle
        self._metrics = metrics
        self._on_fatal = on_fatal
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvpilot-engine-loop", daemon=True)
        self._active: dict[str, ServingRequest] = {}
        self._draining = False
        self._failed = False
        self.info: EngineInfo | None = None
        #: the latest /load snapshot (replaced as a whole by the engine thread)
        self.load: dict = initial_load
        #: monotonic time the loop last finished an iteration (or a warm-up bucket)
        self.heartbeat = time.monotonic()

    # ---- thread-safe API ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, batch: list[ServingRequest]) -> None:
        self._commands.put(Submit(batch))

    def abort(self, request_ids: list[str]) -> None:
        self._commands.put(Abort(list(request_ids)))

    def resume(self, request_id: str) -> None:
        self._commands.put(Resume(request_id))

    def drain(self) -> None:
        self._commands.put(Drain())

    def kv_snapshot(self) -> concurrent.futures.Future:
        cmd = KVSnapshot()
        self._commands.put(cmd)
        return cmd.future

    def stop(self, timeout_s: float = 10.0) -> None:
        self._commands.put(Stop())
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def healthy(self, now: float) -> bool:
        return (
            self._thread.is_alive()
            and not self._failed
            and now - self.heartbeat < self._config.loop_stall_timeout_s
        )

    # ---- the thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            engine = self._engine_factory()
            self.info = EngineInfo.from_engine(engine)
            sc = engine.config.scheduler
            buckets = effective_buckets(
                self._config.warmup_buckets,
                engine.max_model_len,
                sc.max_num_seqs,
                sc.max_num_batched_tokens,
                sc.enable_chunked_prefill,
            )
            self._lifecycle.enter(Phase.WARMING_UP, total=len(buckets))
            run_warmup(
                engine,
                buckets,
                self._on_warmup_bucket,
                self._lifecycle.record,
            )
        except Exception as err:  # a model that cannot load: say why, and stop the server
            # A bad --model or file (ValueError, OSError) is the user's, said in one line as kvpilot generate
            # says it; anything else may be a bug and keeps its traceback.
            log.error("engine failed to start", exc_info=not isinstance(err, (ValueError, OSError)))
            self._fail(f"engine failed to start: {type(err).__name__}: {err}")
            return
        self._engine = engine
        self._admission = Admission(engine, self._config, self._active, self._metrics)
        self._telemetry = EngineTelemetry(engine, self._metrics)
        self._publish()
        self._lifecycle.enter(Phase.READY)
        try:
            self._serve()
        except Exception as err:
            log.exception("engine loop failed")
            self._fail_requests(
                APIError(500, f"engine failure: {type(err).__name__}", code="engine_failure"),
                "error",
                reclaim=SequenceStatus.FAILED,
            )
            self._fail(f"engine loop failed: {type(err).__name__}: {err}")
        finally:
            engine.shutdown()  # tensor-parallel workers: stopped and joined, none left behind

    def _on_warmup_bucket(self, index: int, bucket: WarmupBucket) -> None:
        self.heartbeat = time.monotonic()
        self._lifecycle.advance(
            index, f"warm-up pass {index + 1}: batch {bucket.batch_size} x {bucket.prompt_len} prompt tokens"
        )

    def _fail(self, reason: str) -> None:
        self._failed = True
        self._lifecycle.fail(reason)
        self._on_fatal(reason)

    def _serve(self) -> None:
        busy = False
        while True:
            if self._admission.pending or any(not r.scheduled for r in self._active.values()):
                wait = 0.0 if busy else QUEUED_WAIT_S
            else:
                wait = 0.0 if busy else IDLE_WAIT_S
            if not self._handle_commands(wait):  # the server is stopping: cancel what is left
                self._fail_requests(
                    draining_error(self._config.retry_after_s), "abort", reclaim=SequenceStatus.CANCELLED
                )
                return
            self._engine.check_health()  # a dead tensor-parallel rank fails the engine while idle too
            now = time.monotonic()
            self._admission.expire(now)
            self._expire_backpressure(now)
            self._admission.admit_pending()
            busy = False
            # an abort leaves its request's last output in the engine until a step takes it: with nothing
            # else live no step would come, and the engine would hold every request aborted meanwhile
            if self._engine.has_unfinished_requests() or self._engine.has_pending_outputs():
                busy = self._step()
            self._telemetry.consume_terminal_records()  # finished, aborted, timed out: one record each
            self._publish()
            self.heartbeat = time.monotonic()

    def _step(self) -> bool:
        """One engine step; False when it could schedule nothing (every live request is backpressured
        or waits for blocks), so the loop sleeps until a command arrives instead of spinning."""
        engine = self._engine
        steps = engine.num_steps
        outs = engine.step()
        self._telemetry.after_step(self._active)
        wakes: Wakes = {}
        for out in outs:
            req = self._active.get(out.request_id)
            if req is None:
                continue  # aborted by the server a moment ago; its client was already answered
            chunk = req.deltas.update(out)
            if chunk is not None and req.stream.put(chunk, max_json_bytes(chunk), wakes):
                engine.set_backpressure(req.request_id, True)
                req.paused_since = time.monotonic()
                self._metrics.backpressure_pauses.inc()
            if out.finished:
                del self._active[out.request_id]
        wake_all(wakes)  # the step's waiting handlers, in one hop to the event loop
        return engine.num_steps != steps

    def _expire_backpressure(self, now: float) -> None:
        """docs/architecture.md#backpressure-and-cancellation: a full buffer cannot wait forever — a client
        that stopped reading but keeps its connection open would hold KV blocks and a batch slot
        indefinitely."""
        timeout = self._config.backpressure_timeout_s
        if timeout <= 0:
            return
        for req in [
            r for r in self._active.values() if r.paused_since is not None and now - r.paused_since > timeout
        ]:
            self._engine.abort_request(req.request_id, SequenceStatus.CANCELLED)
            del self._active[req.request_id]
            req.fail(
                APIError(
                    503,
                    f"the client did not read its stream for {timeout:g} s; request cancelled",
                    code="client_too_slow",
                ),
                "abort",
            )

    def _handle_commands(self, wait_s: float) -> bool:
        """Run every queued command (waiting up to ``wait_s`` for the first); False on stop."""
        try:
            cmd = self._commands.get(timeout=wait_s) if wait_s > 0 else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(cmd, Stop):
                return False
            self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, cmd: object) -> None:
        engine = self._engine
        if isinstance(cmd, Submit):
            if self._draining:
                for req in cmd.batch:
                    req.fail(draining_error(self._config.retry_after_s), None, whole_batch=True)
            else:
                self._admission.submit(cmd.batch)
        elif isinstance(cmd, Abort):
            for rid in cmd.request_ids:
                if not self._admission.remove_pending(rid) and self._active.pop(rid, None) is not None:
                    engine.abort_request(rid, SequenceStatus.CANCELLED)
        elif isinstance(cmd, Resume):
            resumed = self._active.get(cmd.request_id)
            if resumed is not None:
                engine.set_backpressure(cmd.request_id, False)
                resumed.paused_since = None
        elif isinstance(cmd, KVSnapshot):
            if not cmd.future.set_running_or_notify_cancel():
                return
            cmd.future.set_result(kv_snapshot(engine))
        elif isinstance(cmd, Drain):
            self._draining = True
            self._admission.drain()

    def _fail_requests(self, error: APIError, finish_reason: str, reclaim: SequenceStatus) -> None:
        """End every open request with ``error`` (pending ones count as turned away). Each live one goes
        through the engine's reclaim routine as ``reclaim`` (CANCELLED when stopping, FAILED after an
        engine failure), so it frees its blocks and writes its one terminal record. After a failure the
        engine's state may be broken: a reclaim that raises stops reclaiming, the clients are answered."""
        for req in self._admission.pending:
            req.fail(error, None)
        self._admission.pending.clear()
        reclaiming = True
        for req in self._active.values():
            if reclaiming:
                try:
                    self._engine.abort_request(req.request_id, reclaim)
                except Exception:  # the engine is already failing: answer every client regardless
                    log.exception("reclaiming %s after the engine failure failed", req.request_id)
                    reclaiming = False
            req.fail(error, finish_reason)
        self._active.clear()
        if reclaiming:
            self._telemetry.consume_terminal_records()

    def _publish(self) -> None:
        snap = load_snapshot(self._engine)
        admission = self._admission
        snap["waiting"] += len(admission.pending)
        snap["queued_prefill_tokens"] += admission.pending_prompt_tokens
        snap["pending_admission"] = len(admission.pending)
        snap["backpressured"] = sum(1 for r in self._active.values() if r.stream.backpressured)
        self.load = snap
