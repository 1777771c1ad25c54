"""Who a request belongs to, derived identically by the engine server and the router (no torch here).

The tenant id salts the prefix-cache block hashes (``cache_salt``), so tenants never share cached blocks
and cannot probe each other's prefixes through cache-hit timing, and it keys the per-tenant rate limit.
Rule, in order (``resolve_tenant``):
1. the ``x-tenant`` header, when present and non-empty and the server may believe it: it has no API keys
   (no identities to protect), or it trusts the header (``--trust-tenant-header``, behind a proxy that
   sets it), or the request comes from the router sidecar, proven by the deployment's shared token in
   ``x-kvpilot-router-token``. With API keys, anyone else's ``x-tenant`` is ignored: a key cannot claim
   another tenant's cache or rate bucket;
2. otherwise the tenant bound to the presented API key (``--api-key KEY:TENANT``), else a digest of the
   key, so the key itself never appears in hashes, logs or metrics;
3. otherwise no tenant: the request uses the shared, unsalted cache.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

TENANT_HEADER = "x-tenant"
ROUTER_TOKEN_HEADER = "x-kvpilot-router-token"
#: where the engine and the router find the deployment's shared token (the operator mounts it from a Secret)
ROUTER_TOKEN_ENV = "KVPILOT_ROUTER_TOKEN"
MAX_TENANT_LEN = 128


class TenantError(ValueError):
    """The tenant header is malformed (too long or not printable ASCII)."""


def api_key_from_headers(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization") or headers.get("Authorization")
    if not auth:
        return None
    scheme, _, key = auth.partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


@dataclass(frozen=True)
class TenantPolicy:
    """Whom the server believes about tenants."""

    #: API keys are configured: requests are authenticated, so a claimed tenant needs a trusted source
    authenticated: bool = False
    #: believe ``x-tenant`` from any client (a deployment behind a proxy that sets it)
    trust_header: bool = False
    #: believe ``x-tenant`` from a peer presenting this token (the router sidecar); None = nobody
    router_token: str | None = field(default=None, repr=False)
    #: API key → the tenant it is bound to (keys not listed get their digest)
    key_tenants: Mapping[str, str] = field(default_factory=dict, repr=False)

    def believes_header(self, headers: Mapping[str, str]) -> bool:
        if not self.authenticated or self.trust_header:
            return True
        given = headers.get(ROUTER_TOKEN_HEADER)
        return (
            self.router_token is not None
            and given is not None
            and hmac.compare_digest(given.encode(), self.router_token.encode())
        )


def _well_formed(tenant: str) -> bool:
    """A tenant id: printable ASCII of at most ``MAX_TENANT_LEN`` characters (header and key bindings
    alike)."""
    return len(tenant) <= MAX_TENANT_LEN and tenant.isascii() and tenant.isprintable()


def _header_tenant(headers: Mapping[str, str]) -> str | None:
    raw = headers.get(TENANT_HEADER) or headers.get(TENANT_HEADER.title())
    if raw is None or not raw.strip():
        return None
    tenant = raw.strip()
    if not _well_formed(tenant):
        raise TenantError(f"{TENANT_HEADER} must be printable ASCII of at most {MAX_TENANT_LEN} characters")
    return tenant


def key_tenant(key: str) -> str:
    """The tenant of an API key without a binding: a digest, so the key never appears in hashes or logs."""
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]


def resolve_tenant(headers: Mapping[str, str], policy: TenantPolicy) -> str | None:
    """The request's tenant under ``policy`` (the module's rule); ``TenantError`` for a malformed header."""
    claimed = _header_tenant(headers)
    if claimed is not None and policy.believes_header(headers):
        return claimed
    key = api_key_from_headers(headers)
    if key:
        return policy.key_tenants.get(key) or key_tenant(key)
    return None


def tenant_from_headers(headers: Mapping[str, str]) -> str | None:
    """The tenant as a server without API keys sees it (``x-tenant``, else the key's digest)."""
    return resolve_tenant(headers, TenantPolicy())


def read_api_keys_file(path: str) -> list[str]:
    """The ``KEY`` / ``KEY:TENANT`` lines of an API-keys file (blank lines and ``#`` comments skipped);
    ``OSError`` if it cannot be read."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def key_bindings(specs: Iterable[str]) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """``KEY`` / ``KEY:TENANT`` specs → (every key, the (key, tenant) bindings); ``TenantError`` for a
    malformed binding."""
    keys, bindings = [], []
    for spec in specs:
        key, tenant = parse_api_key(spec)
        keys.append(key)
        if tenant is not None:
            bindings.append((key, tenant))
    return tuple(keys), tuple(bindings)


def parse_api_key(spec: str) -> tuple[str, str | None]:
    """``KEY`` or ``KEY:TENANT`` (split at the last colon) → (key, bound tenant or None)."""
    key, sep, tenant = spec.rpartition(":")
    if not sep:
        return spec, None
    if not key or not tenant or not _well_formed(tenant):
        raise TenantError(
            f"--api-key {'KEY:TENANT'!r}: the key and a printable ASCII tenant of at most "
            f"{MAX_TENANT_LEN} characters, got a malformed binding"
        )
    return key, tenant
