"""The exact-admission policy (engine/server/admission.py) on a real tiny engine, with explicit clocks:
KV reservation after the prefix lookup, the bounded queue, FIFO pending admission, the queue deadline,
the best_of degrade, and draining."""

from __future__ import annotations

import asyncio

import pytest

from kvpilot.engine.engine_args import EngineArgs
from kvpilot.engine.engine_core import LLMEngine
from kvpilot.engine.sampling.params import SamplingParams
from kvpilot.engine.server.admission import Admission
from kvpilot.engine.server.config import ServerConfig
from kvpilot.engine.server.metrics import ServerMetrics
from kvpilot.engine.server.request_stream import RequestStream
from kvpilot.engine.server.serving_request import Failure, ServingRequest
from kvpilot.engine.server.tracing import NO_SPAN

BLOCK = 16


@pytest.fixture
def engine(tiny_model_dir) -> LLMEngine:
    # 16 blocks: block 0 is reserved, 15 usable (240 tokens)
    return LLMEngine(EngineArgs(model="tiny-random", num_kv_blocks=16, max_num_seqs=4).create_config())


@pytest.fixture
def event_loop_obj():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


class Harness:
    def __init__(self, engine: LLMEngine, loop, **config) -> None:
        self.engine = engine
        self.loop = loop
        self.active: dict[str, ServingRequest] = {}
        self.metrics = ServerMetrics("tiny-random")
        self.admission = Admission(engine, ServerConfig(**config), self.active, self.metrics)

    def request(self, rid: str, prompt_len: int, arrival: float = 0.0, **params) -> ServingRequest:
        ids = [(7 * len(rid) + 3 * j) % 500 + 3 for j in range(prompt_len)]
        stream = RequestStream(self.loop, 8, 4, lambda: None)
        params = SamplingParams(max_tokens=4, **params)
        return ServingRequest(rid, ids, params, None, 0, arrival, stream, NO_SPAN)


def outcome(req: ServingRequest):
    """What admission put on the request's stream (status, code, finish reason, Retry-After), or None;
    taken off the stream, as the handler would take it."""
    item = req.stream.take_nowait()
    if item is None:
        return None
    assert isinstance(item, Failure)
    return item.error.status, item.error.code, item.finish_reason, item.error.retry_after


def degraded_total(h: Harness) -> float | None:
    """kvpilot_requests_degraded_total as /metrics exposes it."""
    return h.metrics.registry.get_sample_value(
        "kvpilot_requests_degraded_total", {"model_name": "tiny-random"}
    )


def test_fits_now_is_admitted_with_its_reservation(engine, event_loop_obj):
    h = Harness(engine, event_loop_obj)
    req = h.request("a", 40)  # 41 tokens (prompt + first output) = 3 blocks
    h.admission.submit([req])
    assert outcome(req) is None and "a" in h.active and engine.has_unfinished_requests()
    assert (req.cost_blocks, engine.kv.num_reserved_blocks, engine.admission_headroom()) == (3, 3, 12)


def test_a_request_larger_than_the_cache_is_400(engine, event_loop_obj):
    h = Harness(engine, event_loop_obj)
    ok, huge = h.request("ok", 10), h.request("huge", 240, n=1, best_of=4)  # 16 blocks even at n = 1
    h.admission.submit([ok, huge])
    assert outcome(huge) == (400, "exceeds_kv_capacity", None, None)
    assert outcome(ok) == (400, "exceeds_kv_capacity", None, None)  # a batch is admitted as a whole
    assert not h.active and not engine.has_unfinished_requests()


def test_pending_until_headroom_frees_in_fifo_order(engine, event_loop_obj):
    h = Harness(engine, event_loop_obj)
    big = h.request("big", 150)  # 10 blocks
    h.admission.submit([big])
    second, small = h.request("second", 100), h.request("small", 5)  # 7 blocks > 5 left; 1 block fits
    h.admission.submit([second])
    h.admission.submit([small])
    assert list(h.admission.pending) == [second, small]  # small fits, but may not overtake
    assert h.admission.queue_length == 3 and h.admission.pending_prompt_tokens == 105
    engine.abort_request("big")
    del h.active["big"]
    h.admission.admit_pending()
    assert not h.admission.pending and set(h.active) == {"second", "small"}


def test_queue_full_is_429_with_retry_after(engine, event_loop_obj):
    h = Harness(engine, event_loop_obj, max_queue_len=2, retry_after_s=3)
    first, second = h.request("first", 10), h.request("second", 10)
    h.admission.submit([first, second])  # admitted, not yet scheduled: both count as queued
    third = h.request("third", 10)
    h.admission.submit([third])
    assert outcome(third) == (429, "queue_full", None, 3)
    engine.step()
    first.scheduled = second.scheduled = True
    h.admission.submit([h.request("fourth", 10)])
    assert "fourth" in h.active


def test_queue_deadline_drops_pending_and_unscheduled_requests(engine, event_loop_obj):
    h = Harness(engine, event_loop_obj, queue_timeout_s=2.0, retry_after_s=1)
    running = h.request("running", 150, arrival=0.0)
    h.admission.submit([running])
    engine.step()
    running.scheduled = True
    waiting = h.request("waiting", 100, arrival=1.0)  # does not fit: pending
    h.admission.submit([waiting])
    h.admission.expire(now=2.5)  # running was scheduled in time; waiting has waited 1.5 s
    assert outcome(waiting) is None
    h.admission.expire(now=3.5)
    assert outcome(waiting) == (503, "queue_timeout", "timeout", 1)
    assert outcome(running) is None and set(h.active) == {"running"}
    queued = h.request("queued", 5, arrival=10.0)  # admitted (reserved) but never scheduled
    h.admission.submit([queued])
    h.admission.expire(now=12.5)
    assert outcome(queued) == (503, "queue_timeout", "timeout", 1)
    assert set(h.active) == {"running"} and engine.kv.num_reserved_blocks == 0


def test_best_of_degrades_to_n_when_only_that_fits(engine, event_loop_obj):
    h = Harness(engine, event_loop_obj)
    h.admission.submit([h.request("filler", 100)])  # 7 blocks: 8 left
    req = h.request("best", 80, n=1, best_of=4, temperature=1.0)  # 6 blocks + 3 samples = 9 > 8
    h.admission.submit([req])
    assert outcome(req) is None and req.degraded and req.params.best_of is None
    assert req.cost_blocks == 6 and "best" in h.active
    assert degraded_total(h) == 1


def test_best_of_larger_than_the_cache_degrades_to_n_before_it_is_refused(engine, event_loop_obj):
    h = Harness(engine, event_loop_obj)
    req = h.request("big-best-of", 200, n=1, best_of=4, temperature=1.0)  # 13 + 3 blocks > 15; 13 fit
    h.admission.submit([req])
    assert outcome(req) is None and req.degraded and req.params.best_of is None
    assert req.cost_blocks == 13 and "big-best-of" in h.active
    assert degraded_total(h) == 1


def test_drain_turns_away_what_has_not_started(engine, event_loop_obj):
    h = Harness(engine, event_loop_obj, retry_after_s=2)
    running = h.request("running", 150)
    h.admission.submit([running])
    engine.step()
    running.scheduled = True
    queued, pending = h.request("queued", 5), h.request("pending", 100)
    h.admission.submit([queued])
    h.admission.submit([pending])
    h.admission.drain()
    assert outcome(queued) == outcome(pending) == (503, "draining", None, 2)
    assert set(h.active) == {"running"} and not h.admission.pending
