"""Per-tenant token buckets: the rate part of the ingress gate (docs/architecture.md#admission, phase one,
before tokenization).

Each tenant (``kvpilot.engine.tenancy.tenant_from_headers``; requests without one share the anonymous
bucket) holds up to ``burst`` tokens, refilled at ``rate`` per second; a request takes one. Memory stays
bounded: only the ``max_tenants`` most recently seen tenants keep a bucket, and a forgotten tenant comes
back with a full one (which is what an idle tenant's bucket would hold anyway). Used from the event loop
only, so it needs no lock.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

ANONYMOUS = ""


class TenantRateLimiter:
    def __init__(
        self,
        rate: float,
        burst: float,
        max_tenants: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate <= 0 or burst < 1 or max_tenants < 1:
            raise ValueError(
                f"need rate > 0, burst >= 1, max_tenants >= 1; got {rate}, {burst}, {max_tenants}"
            )
        self.rate = rate
        self.burst = burst
        self.max_tenants = max_tenants
        self._clock = clock
        #: tenant -> (tokens, time of the last refill), least recently seen first
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def acquire(self, tenant: str | None) -> float:
        """Take one token for ``tenant``: 0.0 when granted, else the seconds until one is available."""
        key = ANONYMOUS if tenant is None else tenant
        now = self._clock()
        tokens, last = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        if tokens >= 1.0:
            self._buckets[key] = (tokens - 1.0, now)
            wait = 0.0
        else:
            self._buckets[key] = (tokens, now)
            wait = (1.0 - tokens) / self.rate
        while len(self._buckets) > self.max_tenants:
            self._buckets.popitem(last=False)
        return wait

    @staticmethod
    def retry_after(wait_s: float) -> int:
        """``Retry-After`` is whole seconds; round up so a client that obeys it finds a token."""
        return max(1, math.ceil(wait_s))

    def __len__(self) -> int:
        return len(self._buckets)
