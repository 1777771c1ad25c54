"""Typed router configuration, validated once at the boundary (the CLI builds it; every module reads it).

Every value here is checked when the dataclass is built, so the rest of the router can trust it; a bad value
raises :class:`ConfigError` whose message names the flag or weight and what is accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from urllib.parse import urlsplit

from kvpilot.engine.server.connection import MIN_BUDGET_BYTES, ConnectionLimits
from kvpilot.engine.tenancy import TenantPolicy

POLICIES = ("cache_aware", "least_loaded", "round_robin")


class ConfigError(ValueError):
    """A configuration value is invalid; the message is meant for the person who typed it."""


@dataclass(frozen=True)
class ScoringWeights:
    """Knobs of the cache-aware cost, set with ``--weights k=v,...`` (the keys are these field names).

    cost(replica) = (queue × queued prefill tokens + prefill × this request's uncached tokens)
                    / learned prefill rate + decode × decode-step seconds
    """

    #: multiplier on the prefill tokens already queued at the replica (work ahead of this request)
    queue: float = 1.0
    #: multiplier on this request's own uncached prompt tokens there (the work a cache hit saves). Above 1
    #: because recomputing a prefix costs more than this request's wait: the work also delays everyone queued
    #: behind it there and puts a second copy of the prefix in another cache. At 2, a prefix stays on its
    #: replica until that replica's queue costs more than computing the prefix twice.
    prefill: float = 2.0
    #: multiplier on the decode term: one decode step of the replica's running batch, which the first
    #: token waits for (0 on an idle replica)
    decode: float = 1.0
    #: hot-spot guard (bounded-load hashing): a replica whose outstanding requests reach
    #: ceil((1 + balance) × (all outstanding + 1) / replicas) takes no new request while others can
    balance: float = 0.5
    #: ... unless it has fewer outstanding requests than this (low load never breaks affinity)
    balance_floor: float = 8.0
    #: costs within this many milliseconds of the best are tied; the rendezvous hash of the request's
    #: first block breaks the tie, so independent routers pick the same replica
    tie_ms: float = 5.0

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
            ):
                raise ConfigError(f"weight {item.name} must be a finite number >= 0, got {value!r}")

    @classmethod
    def parse(cls, text: str) -> ScoringWeights:
        """``"queue=1,decode=0.5"`` → weights (unnamed keys keep their defaults)."""
        known = [item.name for item in fields(cls)]
        values: dict[str, float] = {}
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            key, sep, raw = part.partition("=")
            key = key.strip()
            if not sep or not key:
                raise ConfigError(f"--weights entries are key=value, got {part!r}")
            if key not in known:
                raise ConfigError(f"unknown weight {key!r}; known: {', '.join(known)}")
            if key in values:
                raise ConfigError(f"weight {key!r} is given twice")
            try:
                values[key] = float(raw)
            except ValueError:
                raise ConfigError(f"weight {key} must be a number, got {raw.strip()!r}") from None
        return cls(**values)


@dataclass(frozen=True)
class PollConfig:
    """How each replica's ``/load`` and ``/kv/events`` are polled."""

    #: seconds between polls of one replica (the contract asks for 0.1–0.25 s)
    interval_s: float = 0.1
    #: a poll slower than this counts as a failure and ejects the replica
    timeout_s: float = 1.0

    def __post_init__(self) -> None:
        _check_positive("--poll-interval", self.interval_s)
        _check_positive("--poll-timeout", self.timeout_s)


@dataclass(frozen=True)
class UpstreamConfig:
    """Limits of the proxied requests."""

    #: TCP connect to an engine; a timeout ejects the replica and retries elsewhere
    connect_timeout_s: float = 2.0
    #: the whole upstream request, streaming included (long generations need long limits)
    request_timeout_s: float = 600.0
    #: largest request body accepted from clients: the engine's own default limit (``kvpilot serve
    #: --max-body-bytes``), so the router never buffers and parses a body every engine would refuse
    max_body_bytes: int = 8 * 1024 * 1024
    #: seconds a client's whole request body may take to arrive (408 after), as the engine's
    #: ``--body-read-timeout``: a slow sender cannot hold a connection and its buffer forever
    body_read_timeout_s: float = 30.0
    #: bytes of one stream the router holds for a client that does not read: a quarter in the client
    #: connection's write buffer, a quarter in its kernel send buffer (SO_SNDBUF), a quarter in the
    #: upstream response's read buffer, a quarter in the upstream socket's receive buffer (SO_RCVBUF);
    #: beyond it the engine's own buffers fill and it pauses the request (``kvpilot serve
    #: --stream-buffer-bytes``)
    stream_buffer_bytes: int = 64 << 10
    #: a client connection that accepts no bytes for this long is closed (TCP_USER_TIMEOUT) and its
    #: upstream request with it; shorter than the engine's ``--write-stall-timeout`` (180 s), so the
    #: router, not the engine, ends such a stream and the replica is never taken for a failed one
    write_stall_timeout_s: float = 150.0

    def __post_init__(self) -> None:
        _check_positive("--connect-timeout", self.connect_timeout_s)
        _check_positive("--request-timeout", self.request_timeout_s)
        _check_positive("--body-read-timeout", self.body_read_timeout_s)
        if self.max_body_bytes <= 0:
            raise ConfigError(f"--max-body-bytes must be positive, got {self.max_body_bytes}")
        if self.stream_buffer_bytes < MIN_BUDGET_BYTES:
            raise ConfigError(
                f"--stream-buffer-bytes must be >= {MIN_BUDGET_BYTES}, got {self.stream_buffer_bytes}"
            )
        if not (math.isfinite(self.write_stall_timeout_s) and self.write_stall_timeout_s >= 0):
            raise ConfigError(
                f"--write-stall-timeout must be >= 0 seconds (0 = never), got {self.write_stall_timeout_s}"
            )

    @property
    def client_limits(self) -> ConnectionLimits:
        """Each client connection's share of ``stream_buffer_bytes`` and its stall timeout."""
        return ConnectionLimits.for_budget(self.stream_buffer_bytes, self.write_stall_timeout_s)

    @property
    def upstream_read_bytes(self) -> int:
        """aiohttp's read buffer size for upstream responses (it stops reading at twice this) and the
        SO_RCVBUF of upstream sockets (the kernel doubles it): an eighth of the budget each."""
        return self.stream_buffer_bytes // 8


@dataclass(frozen=True)
class DiscoveryConfig:
    """Where the engine replicas come from: a static list or a Service's EndpointSlices."""

    #: engine base URLs (``http://host:port``), for a static fleet
    replicas: tuple[str, ...] = ()
    #: the Service whose EndpointSlices list the engines (``kubernetes.io/service-name`` label)
    endpointslice_service: str | None = None
    #: namespace of that Service
    namespace: str | None = None
    #: the EndpointSlice port (by name) the engines listen on; a slice with a single port uses that one
    port_name: str = "http"

    def __post_init__(self) -> None:
        if bool(self.replicas) == bool(self.endpointslice_service):
            raise ConfigError("give exactly one of --replicas URL,URL or --endpointslices SERVICE")
        if self.endpointslice_service and not self.namespace:
            raise ConfigError("--endpointslices needs --namespace (or a pod service-account namespace file)")
        for url in self.replicas:
            check_replica_url(url)
        if len(set(self.replicas)) != len(self.replicas):
            raise ConfigError("--replicas lists a URL twice")


@dataclass(frozen=True)
class RouterConfig:
    """Everything ``kvpilot router`` runs with."""

    discovery: DiscoveryConfig
    host: str = "0.0.0.0"
    port: int = 8080
    #: model spec whose tokenizer and chat template the router uses (as ``kvpilot serve --model``)
    model: str = "smollm2-135m"
    policy: str = "cache_aware"
    weights: ScoringWeights = field(default_factory=ScoringWeights)
    poll: PollConfig = field(default_factory=PollConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    #: prefill tokens/s assumed for a replica before it or any peer has measured one
    prefill_rate_prior: float = 2000.0
    #: divide each replica's work by its own measured prefill rate instead of the fleet's median. Only for
    #: fleets of mixed hardware: a rate is measured under whatever load the replica had (a step batching
    #: several prompts runs more tokens per second than one short prompt), so per-replica rates make the
    #: busiest replica look fastest and cold requests pile onto it
    per_replica_prefill_rate: bool = False
    #: believe the client's ``x-tenant`` and vouch for it to the engines with ``router_token`` (only behind
    #: a gateway that sets the header); otherwise the engines decide the tenant themselves
    trust_tenant_header: bool = False
    #: the deployment's shared token (``$KVPILOT_ROUTER_TOKEN``, provisioned by the operator); a client's own
    #: ``x-kvpilot-router-token`` is never passed on
    router_token: str | None = field(default=None, repr=False)
    #: the engines' API keys are known (``--api-key`` / ``--api-keys-file``, the same as the engines'): the
    #: router then predicts each request's tenant as the engines derive it — from its key, ignoring a
    #: client's ``x-tenant`` unless ``trust_tenant_header`` — so its block hashes carry the engines' salt
    api_keys_known: bool = False
    #: (key, tenant) bindings of those keys, as the engines' ``KEY:TENANT``
    api_key_tenants: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    def tenant_policy(self) -> TenantPolicy:
        """How the engines behind this router derive a request's tenant (what the router must predict)."""
        return TenantPolicy(
            authenticated=self.api_keys_known,
            trust_header=self.trust_tenant_header,  # the router vouches for the header it forwards
            key_tenants=dict(self.api_key_tenants),
        )

    def __post_init__(self) -> None:
        if self.trust_tenant_header and not self.router_token:
            raise ConfigError(
                "--trust-tenant-header needs --router-token (or $KVPILOT_ROUTER_TOKEN): the "
                "engines believe a tenant the router names only with the deployment's token"
            )
        if self.router_token is not None and len(self.router_token) < 16:  # as kvpilot serve: a short one
            # passed here and every vouched request then failed at the engines
            raise ConfigError("--router-token must be at least 16 characters (the operator provisions 64)")
        if self.policy not in POLICIES:
            raise ConfigError(f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be 0..65535, got {self.port}")
        _check_positive("--prefill-rate-prior", self.prefill_rate_prior)


def check_replica_url(url: str) -> str:
    """``url`` if it is an engine base URL (http(s)://host:port, no path); else :class:`ConfigError`."""
    try:
        parts = urlsplit(url)
    except ValueError as error:  # "Invalid IPv6 URL": said without the URL or the flag
        raise ConfigError(f"replica URL {url!r}: {error}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"replica URL must look like http://host:port, got {url!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"replica URL must be the engine's root without a path, got {url!r}")
    try:
        parts.port  # noqa: B018 -- raises ValueError for a port out of range
    except ValueError:
        raise ConfigError(f"replica URL has an invalid port: {url!r}") from None
    return url


def _check_positive(flag: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{flag} must be a positive number, got {value}")
