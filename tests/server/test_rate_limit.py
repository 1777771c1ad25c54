"""Per-tenant token buckets with an explicit clock: burst, refill, Retry-After rounding, separate tenants,
bounded memory."""

from __future__ import annotations

import pytest

from kvpilot.engine.server.rate_limit import TenantRateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_burst_then_refill_at_the_rate():
    clock = Clock()
    limiter = TenantRateLimiter(rate=2.0, burst=3, clock=clock)
    assert [limiter.acquire("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.acquire("a") == pytest.approx(0.5)  # empty: one token every 0.5 s
    clock.now += 0.25
    # half a token so far (a refused request took none)
    assert limiter.acquire("a") == pytest.approx(0.25)
    clock.now += 0.25
    assert limiter.acquire("a") == 0.0
    clock.now += 10
    # refilled to the burst, not more
    assert [limiter.acquire("a") for _ in range(4)][-1] == pytest.approx(0.5)


def test_tenants_have_their_own_buckets_and_anonymous_requests_share_one():
    limiter = TenantRateLimiter(rate=0.1, burst=1, clock=Clock())
    assert (limiter.acquire("a"), limiter.acquire("b"), limiter.acquire(None)) == (0.0, 0.0, 0.0)
    assert limiter.acquire("a") == pytest.approx(10.0)
    assert limiter.acquire(None) == pytest.approx(10.0)


def test_retry_after_rounds_up_to_whole_seconds():
    assert [TenantRateLimiter.retry_after(w) for w in (0.01, 1.0, 1.2, 9.99)] == [1, 1, 2, 10]


def test_only_the_most_recent_tenants_keep_a_bucket():
    clock = Clock()
    limiter = TenantRateLimiter(rate=1.0, burst=1, max_tenants=2, clock=clock)
    for tenant in ("a", "b", "c"):
        limiter.acquire(tenant)
    assert len(limiter) == 2
    assert limiter.acquire("a") == 0.0  # forgotten, so it comes back full
    assert limiter.acquire("c") == pytest.approx(1.0)  # still tracked, still empty


@pytest.mark.parametrize(("rate", "burst", "tenants"), [(0, 1, 1), (1, 0.5, 1), (1, 1, 0)])
def test_invalid_settings_are_refused(rate, burst, tenants):
    with pytest.raises(ValueError, match="need rate > 0"):
        TenantRateLimiter(rate, burst, tenants)
