"""AWS Signature Version 4 for the one request the fetcher makes to an S3-compatible endpoint: a GET of an
object, path-style (``<endpoint>/<bucket>/<key>``), so no SDK is needed
(docs/architecture.md#model-delivery). The steps are AWS's: canonical request → string to sign → HMAC
chain of the date, region and service →
``Authorization: AWS4-HMAC-SHA256 Credential=…, SignedHeaders=…, Signature=…``.
"""

from __future__ import annotations

import hashlib
import hmac
import urllib.parse
from dataclasses import dataclass
from datetime import datetime

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()  # the payload hash of a GET


@dataclass(frozen=True)
class Credentials:
    access_key: str
    secret_key: str
    session_token: str | None = None


def _hmac(key: bytes, message: str) -> bytes:
    return hmac.new(key, message.encode(), hashlib.sha256).digest()


def _canonical_path(path: str) -> str:
    # S3 encodes each segment once (RFC 3986 unreserved characters stay), keeping the slashes.
    return "/".join(urllib.parse.quote(urllib.parse.unquote(part), safe="-_.~") for part in path.split("/"))


_DEFAULT_PORTS = {"http": 80, "https": 443}


def request_host(parts: urllib.parse.SplitResult) -> str:
    """The Host header of a request to ``parts``, as HTTP clients send it and S3 verifies it: the host
    lower-cased (IPv6 in brackets), the port only when it is not the scheme's default (botocore's rule)."""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port is not None and parts.port != _DEFAULT_PORTS.get(parts.scheme):
        host = f"{host}:{parts.port}"
    return host


def sign_get(
    url: str,
    credentials: Credentials,
    region: str,
    now: datetime,
    headers: dict[str, str] | None = None,
    service: str = "s3",
) -> dict[str, str]:
    """The headers of a signed GET of ``url`` at ``now`` (UTC): ``headers`` plus host, x-amz-date,
    x-amz-content-sha256, the session token if any, and Authorization. The caller sends them all, host
    included, so that the server verifies the very Host that was signed."""
    parts = urllib.parse.urlsplit(url)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    signed = {k.lower(): v.strip() for k, v in (headers or {}).items()}
    signed |= {"host": request_host(parts), "x-amz-date": amz_date, "x-amz-content-sha256": EMPTY_SHA256}
    if credentials.session_token:
        signed["x-amz-security-token"] = credentials.session_token
    names = sorted(signed)
    query = "&".join(
        f"{urllib.parse.quote(k, safe='-_.~')}={urllib.parse.quote(v, safe='-_.~')}"
        for k, v in sorted(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    )
    canonical = "\n".join(
        [
            "GET",
            _canonical_path(parts.path or "/"),
            query,
            "".join(f"{name}:{signed[name]}\n" for name in names),
            ";".join(names),
            EMPTY_SHA256,
        ]
    )
    scope = f"{amz_date[:8]}/{region}/{service}/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = _hmac(("AWS4" + credentials.secret_key).encode(), amz_date[:8])
    for part in (region, service, "aws4_request"):
        key = _hmac(key, part)
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    authorization = (
        f"AWS4-HMAC-SHA256 Credential={credentials.access_key}/{scope},"
        f"SignedHeaders={';'.join(names)},Signature={signature}"
    )
    return {**signed, "authorization": authorization}
