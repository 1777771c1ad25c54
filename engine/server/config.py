"""Typed configuration of ``kvpilot serve`` (the HTTP side; engine args live in ``kvpilot.engine.config``),
validated once at the boundary: an invalid value raises ``ServerConfigError`` naming the flag."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from kvpilot.engine.server.connection import MIN_BUDGET_BYTES, ConnectionLimits
from kvpilot.engine.tenancy import TenantPolicy


class ServerConfigError(ValueError):
    """A server option is invalid; the message names the flag and what it accepts."""


@dataclass(frozen=True)
class WarmupBucket:
    """One warm-up shape: ``batch_size`` requests of ``prompt_len`` prompt tokens, prefilled together and
    then decoded together for one step."""

    batch_size: int
    prompt_len: int


#: prefill/decode at batch 1, a small batch, and one long prompt (covers both attention paths)
DEFAULT_WARMUP_BUCKETS = (WarmupBucket(1, 16), WarmupBucket(8, 64), WarmupBucket(1, 1024))


def parse_warmup_buckets(text: str) -> tuple[WarmupBucket, ...]:
    """``"1x16,8x64"`` → buckets (batch x prompt tokens); ``"none"`` or ``""`` → no warm-up passes."""
    text = text.strip()
    if text.lower() in ("", "none"):
        return ()
    buckets = []
    for item in text.split(","):
        batch, sep, length = item.strip().lower().partition("x")
        if not sep or not batch.isdigit() or not length.isdigit() or int(batch) < 1 or int(length) < 1:
            raise ServerConfigError(
                f"--warmup-buckets: {item.strip()!r} is not BATCHxTOKENS with both >= 1 "
                "(example: 1x16,8x64; 'none' skips the warm-up passes)"
            )
        buckets.append(WarmupBucket(int(batch), int(length)))
    return tuple(buckets)


@dataclass(frozen=True)
class ServerConfig:
    #: address to listen on (all interfaces by default: the pod IP must reach it)
    host: str = "0.0.0.0"
    port: int = 8000
    #: accepted bearer keys for ``/v1/*``; empty = no authentication
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    #: (key, tenant) bindings: requests with that key belong to that tenant (``--api-key KEY:TENANT``)
    api_key_tenants: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    #: believe any client's ``x-tenant`` even with API keys (only behind a proxy that sets the header)
    trust_tenant_header: bool = False
    #: the deployment's shared token: a peer presenting it (the router sidecar) may name the tenant
    router_token: str | None = field(default=None, repr=False)
    #: record the request's ``user`` field (often an e-mail address) on its trace span
    trace_user: bool = False
    #: most requests accepted but not yet scheduled (waiting for KV headroom or a batch slot); a request
    #: beyond it gets 429 at once
    max_queue_len: int = 256
    #: seconds a request may wait from arrival until the scheduler first runs it; then 503 (0 = no limit)
    queue_timeout_s: float = 60.0
    #: largest request body in bytes (413 beyond); checked before the body is parsed
    max_body_bytes: int = 8 << 20
    #: seconds the whole request body may take to arrive (408 after): a client trickling bytes cannot hold
    #: a connection and its buffer forever
    body_read_timeout_s: float = 30.0
    #: latency objectives in seconds (None = no objective); a request that meets all given ones counts
    #: toward ``kvpilot_slo_attained_requests_total`` (goodput)
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    #: per-tenant token bucket: sustained requests per second (0 = off) and burst size (None = max(1, rate))
    tenant_rate_limit: float = 0.0
    tenant_burst: float | None = None
    #: tenants whose buckets are kept (least recently seen ones are forgotten, i.e. refilled)
    max_tracked_tenants: int = 10_000
    #: after SIGTERM: seconds in-flight requests get to finish before they are cancelled (the operator's
    #: pod terminationGracePeriodSeconds is 120, so the default leaves time for the process to exit)
    drain_grace_s: float = 90.0
    #: warm-up forward passes run through the engine before ``/ready`` turns 200
    warmup_buckets: tuple[WarmupBucket, ...] = DEFAULT_WARMUP_BUCKETS
    #: output chunks buffered per request before the request is backpressured (not scheduled) until the
    #: client drains half of them
    stream_buffer_chunks: int = 16
    #: bytes of one stream the server holds for a client that does not read: half in its chunk queue
    #: (each chunk counted at an upper bound of the JSON it becomes), a quarter in the connection's write
    #: buffer, a quarter in the kernel's send buffer (SO_SNDBUF); plus the chunk and the write in progress
    stream_buffer_bytes: int = 64 << 10
    #: a request paused this long for a client that does not read is cancelled, freeing its KV blocks and
    #: batch slot for clients that do (0 = wait for the client forever)
    backpressure_timeout_s: float = 120.0
    #: a connection whose client accepts no bytes for this long is closed (TCP_USER_TIMEOUT), cancelling
    #: its request if it still runs; longer than the backpressure timeout, so a client that reads again
    #: late still gets the error event saying why its request was cancelled (0 = never)
    write_stall_timeout_s: float = 180.0
    #: ``Retry-After`` seconds on 429 queue-full and 503 responses
    retry_after_s: int = 1
    #: ``/health`` fails when one engine-loop iteration has run longer than this (a hung device)
    loop_stall_timeout_s: float = 300.0
    #: seconds an idle keep-alive connection stays open; longer than the gaps between a router's requests
    #: to one replica, so its proxied requests reuse connections instead of opening one each (uvicorn's
    #: own default, 5 s, would close them between requests at low rates)
    timeout_keep_alive_s: float = 75.0
    log_level: str = "info"
    #: uvicorn access log lines per request
    access_log: bool = False
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ServerConfigError(msg)

        def finite(value: float | None) -> bool:
            return value is None or math.isfinite(value)

        need(1 <= self.port <= 65535, f"--port must be in [1, 65535], got {self.port}")
        need(
            all(isinstance(k, str) and k and k == k.strip() for k in self.api_keys),
            "--api-key must be a non-empty key without surrounding whitespace",
        )
        need(
            {k for k, _ in self.api_key_tenants} <= set(self.api_keys),
            "every --api-key KEY:TENANT binding must name an accepted key",
        )
        need(
            self.router_token is None or len(self.router_token) >= 16,
            "--router-token must be at least 16 characters (the operator provisions 64)",
        )
        need(self.max_queue_len >= 1, f"--max-queue-len must be >= 1, got {self.max_queue_len}")
        need(
            finite(self.queue_timeout_s) and self.queue_timeout_s >= 0,
            f"--queue-timeout must be >= 0 seconds (0 = no limit), got {self.queue_timeout_s}",
        )
        need(self.max_body_bytes >= 1024, f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        need(
            finite(self.body_read_timeout_s) and self.body_read_timeout_s > 0,
            f"--body-read-timeout must be > 0 seconds, got {self.body_read_timeout_s}",
        )
        for flag, value in (("--slo-ttft", self.slo_ttft_s), ("--slo-tpot", self.slo_tpot_s)):
            need(value is None or (finite(value) and value > 0), f"{flag} must be > 0 seconds, got {value}")
        need(
            finite(self.tenant_rate_limit) and self.tenant_rate_limit >= 0,
            f"--tenant-rate-limit must be >= 0 requests/s (0 = off), got {self.tenant_rate_limit}",
        )
        need(
            self.tenant_burst is None or (finite(self.tenant_burst) and self.tenant_burst >= 1),
            f"--tenant-burst must be >= 1 request, got {self.tenant_burst}",
        )
        need(
            self.max_tracked_tenants >= 1, f"max_tracked_tenants must be >= 1, got {self.max_tracked_tenants}"
        )
        need(
            finite(self.timeout_keep_alive_s) and self.timeout_keep_alive_s > 0,
            f"--timeout-keep-alive must be > 0 seconds, got {self.timeout_keep_alive_s}",
        )
        need(
            finite(self.drain_grace_s) and self.drain_grace_s >= 0,
            f"--drain-grace-seconds must be >= 0, got {self.drain_grace_s}",
        )
        need(
            self.stream_buffer_chunks >= 2,
            f"--stream-buffer-chunks must be >= 2, got {self.stream_buffer_chunks}",
        )
        need(
            self.stream_buffer_bytes >= MIN_BUDGET_BYTES,
            f"--stream-buffer-bytes must be >= {MIN_BUDGET_BYTES}, got {self.stream_buffer_bytes}",
        )
        need(
            finite(self.write_stall_timeout_s) and self.write_stall_timeout_s >= 0,
            f"--write-stall-timeout must be >= 0 seconds (0 = never), got {self.write_stall_timeout_s}",
        )
        need(
            finite(self.backpressure_timeout_s) and self.backpressure_timeout_s >= 0,
            f"--backpressure-timeout must be >= 0 seconds (0 = no limit), got {self.backpressure_timeout_s}",
        )
        need(self.retry_after_s >= 0, f"--retry-after must be >= 0 seconds, got {self.retry_after_s}")
        need(
            finite(self.loop_stall_timeout_s) and self.loop_stall_timeout_s > 0,
            f"--loop-stall-timeout must be > 0 seconds, got {self.loop_stall_timeout_s}",
        )
        need(
            self.log_level in ("critical", "error", "warning", "info", "debug", "trace"),
            f"--log-level must be a uvicorn level, got {self.log_level!r}",
        )

    @functools.cached_property
    def tenant_policy(self) -> TenantPolicy:
        return TenantPolicy(
            authenticated=bool(self.api_keys),
            trust_header=self.trust_tenant_header,
            router_token=self.router_token,
            key_tenants=dict(self.api_key_tenants),
        )

    @property
    def effective_tenant_burst(self) -> float:
        return self.tenant_burst if self.tenant_burst is not None else max(1.0, self.tenant_rate_limit)

    @property
    def connection_limits(self) -> ConnectionLimits:
        """Each accepted connection's share of ``stream_buffer_bytes`` and its stall timeout."""
        return ConnectionLimits.for_budget(self.stream_buffer_bytes, self.write_stall_timeout_s)

    @property
    def stream_queue_bytes(self) -> int:
        """The chunk queue's share of ``stream_buffer_bytes``."""
        return self.stream_buffer_bytes - self.connection_limits.held_bytes

    @property
    def stream_resume_depth(self) -> int:
        """A backpressured request resumes once its buffer has drained to this many chunks."""
        return self.stream_buffer_chunks // 2
