"""Exact admission (docs/architecture.md#admission, phase two: after tokenization and prefix lookup) on the
engine thread.

Policy, in order, for each accepted batch (a completions request with several prompts is one batch and is
admitted or turned away as a whole):
1. A request whose KV reservation (its uncached prompt + one block per extra sample, after the prefix
   lookup) exceeds the whole cache can never run: 400 — unless it is a ``best_of`` > ``n`` request whose
   ``n`` samples would fit, which is degraded to ``best_of`` = ``n`` instead (as in 4).
2. Queue bound: requests accepted but not yet scheduled (pending admission + admitted and waiting for a
   batch slot) may not exceed ``max_queue_len``: otherwise 429 with ``Retry-After`` (reject early, so the
   router or client can go elsewhere instead of waiting behind a queue that cannot clear in time). A batch
   larger than the whole queue never gets here: the completions handler refuses it (400 naming ``prompt``).
3. Admit now — reserve the blocks and hand the request to the scheduler — when its cost fits the headroom
   (free blocks minus outstanding reservations) and nobody is pending ahead of it (FIFO, no overtaking).
4. Degrade: a ``best_of`` > ``n`` request that does not fit is admitted with ``best_of`` = ``n`` when that
   smaller reservation fits now (a degraded admission: counted, and the response says so;
   docs/architecture.md#admission).
5. Otherwise it waits in the pending queue, in arrival order, until headroom frees up.
6. Queue deadline: a request not scheduled within ``queue_timeout`` of its arrival is dropped (its
   reservation rolled back) and answered 503 with ``Retry-After``; nothing was sent, so a router retries it.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import TYPE_CHECKING

from kvpilot.engine.request_validation import RequestError
from kvpilot.engine.sampling.params import SamplingParams
from kvpilot.engine.sequence import SequenceStatus
from kvpilot.engine.server.config import ServerConfig
from kvpilot.engine.server.errors import APIError, bad_request
from kvpilot.engine.server.metrics import ServerMetrics
from kvpilot.engine.server.serving_request import ServingRequest

if TYPE_CHECKING:  # torch: only the engine thread imports the engine
    from kvpilot.engine.engine_core import LLMEngine


def draining_error(retry_after: int) -> APIError:
    return APIError(
        503,
        "the server is draining (shutting down); send the request to another replica",
        code="draining",
        retry_after=retry_after,
    )


class Admission:
    def __init__(
        self,
        engine: LLMEngine,
        config: ServerConfig,
        active: dict[str, ServingRequest],
        metrics: ServerMetrics,
    ) -> None:
        self._engine = engine
        self._config = config
        self._active = active
        self._metrics = metrics
        self._total_blocks = engine.pool.num_usable
        self.pending: deque[ServingRequest] = deque()

    @property
    def queue_length(self) -> int:
        return len(self.pending) + sum(1 for r in self._active.values() if not r.scheduled)

    @property
    def pending_prompt_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.pending)

    def _cost(self, req: ServingRequest, params: SamplingParams | None = None) -> int:
        return self._engine.admission_cost(req.token_ids, params or req.params, req.cache_salt)

    def submit(self, batch: list[ServingRequest]) -> None:
        for req in batch:
            req.cost_blocks = self._cost(req)
            if req.cost_blocks > self._total_blocks:
                cost = self._degraded_cost(req)
                if cost is not None and cost <= self._total_blocks:
                    self._degrade(req, cost)  # best_of could never run, n can: degrade before refusing
            if req.cost_blocks > self._total_blocks:
                error = bad_request(
                    f"the request needs {req.cost_blocks} KV blocks but the cache holds "
                    f"{self._total_blocks}; shorten the prompt or lower n/best_of",
                    code="exceeds_kv_capacity",
                )
                return self._reject(batch, error)
        if self.queue_length + len(batch) > self._config.max_queue_len:
            error = APIError(
                429,
                f"the request queue is full ({self._config.max_queue_len} waiting); retry later",
                code="queue_full",
                retry_after=self._config.retry_after_s,
            )
            return self._reject(batch, error)
        for req in batch:
            admit_now = (
                not self.pending and req.cost_blocks <= self._engine.admission_headroom()
            ) or self._try_degrade(req)
            req.span.event(
                "queued",
                {
                    "prompt_tokens": req.num_prompt_tokens,
                    "kv_blocks": req.cost_blocks,
                    "reserved": admit_now,
                    "degraded": req.degraded,
                },
            )
            if admit_now:
                self._admit(req)
            else:
                self.pending.append(req)
        return None

    def admit_pending(self) -> None:
        while self.pending:
            head = self.pending[0]
            head.cost_blocks = self._cost(head)  # the prefix cache may have changed while it waited
            if head.cost_blocks > self._engine.admission_headroom() and not self._try_degrade(head):
                return
            self.pending.popleft()
            head.span.event("kv_reserved", {"kv_blocks": head.cost_blocks})
            self._admit(head)

    def _degraded_cost(self, req: ServingRequest) -> int | None:
        """The KV cost of ``req`` with ``best_of`` lowered to ``n``; None when it has nothing to lower."""
        p = req.params
        if p.use_beam_search or p.best_of is None or p.best_of <= p.n:
            return None
        return self._cost(req, dataclasses.replace(p, best_of=None))

    def _try_degrade(self, req: ServingRequest) -> bool:
        """Degrade ``req`` if that makes it fit the headroom now (never past requests pending ahead)."""
        if self.pending:
            return False
        cost = self._degraded_cost(req)
        if cost is None or cost > self._engine.admission_headroom():
            return False
        self._degrade(req, cost)
        return True

    def _degrade(self, req: ServingRequest, cost: int) -> None:
        req.params = dataclasses.replace(req.params, best_of=None)
        req.cost_blocks = cost
        req.degraded = True
        self._metrics.degraded.inc()

    def _admit(self, req: ServingRequest) -> None:
        try:
            self._engine.add_request(
                req.request_id,
                req.token_ids,
                req.params,
                arrival_time=req.arrival,
                priority=req.priority,
                cache_salt=req.cache_salt,
            )
        except RequestError as err:
            req.fail(bad_request(str(err)), None)
            return
        self._active[req.request_id] = req

    def _reject(self, batch: list[ServingRequest], error: APIError) -> None:
        for req in batch:
            req.fail(error, None, whole_batch=True)

    def remove_pending(self, request_id: str) -> bool:
        for req in self.pending:
            if req.request_id == request_id:
                self.pending.remove(req)
                return True
        return False

    def expire(self, now: float) -> None:
        """Drop requests that waited past the queue deadline without being scheduled."""
        timeout = self._config.queue_timeout_s
        if timeout <= 0:
            return
        error = APIError(
            503,
            f"the request waited more than {timeout:g} s in the queue; retry later",
            code="queue_timeout",
            retry_after=self._config.retry_after_s,
        )
        for req in [r for r in self.pending if now - r.arrival > timeout]:
            self.pending.remove(req)
            req.fail(error, "timeout")
        for req in [r for r in self._active.values() if not r.scheduled and now - r.arrival > timeout]:
            self._engine.abort_request(req.request_id, SequenceStatus.TIMED_OUT)
            del self._active[req.request_id]
            req.fail(error, "timeout")

    def drain(self) -> None:
        """Shutting down: turn away everything that has not started (a router retries it elsewhere)."""
        error = draining_error(self._config.retry_after_s)
        while self.pending:
            self.pending.popleft().fail(error, None)
        for req in [r for r in self._active.values() if not r.scheduled]:
            self._engine.abort_request(req.request_id, SequenceStatus.CANCELLED)
            del self._active[req.request_id]
            req.fail(error, None)
