"""Who a request belongs to, derived identically by the engine server and the router (no torch here).

The tenant id salts the prefix-cache block hashes (``cache_salt``), so tenants never share cached blocks
and cannot probe each other's prefixes through cache-hit timing. Rule, in order:
1. the ``x-tenant`` header, when present and non-empty;
2. otherwise a digest of the API key (``Authorization: Bearer <key>``), so the key itself never appears
   in hashes, logs or metrics;
3. otherwise no tenant: the request uses the shared, unsalted cache.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

TENANT_HEADER = "x-tenant"
MAX_TENANT_LEN = 128


class TenantError(ValueError):
    """The tenant header is malformed (too long or not printable ASCII)."""


def api_key_from_headers(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization") or headers.get("Authorization")
    if not auth:
        return None
    scheme, _, key = auth.partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


def tenant_from_headers(headers: Mapping[str, str]) -> str | None:
    raw = headers.get(TENANT_HEADER) or headers.get(TENANT_HEADER.title())
    if raw is not None and raw.strip():
        tenant = raw.strip()
        if len(tenant) > MAX_TENANT_LEN or not tenant.isascii() or not tenant.isprintable():
            raise TenantError(f"{TENANT_HEADER} must be printable ASCII of at most {MAX_TENANT_LEN} characters")
        return tenant
    key = api_key_from_headers(headers)
    if key:
        return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]
    return None
