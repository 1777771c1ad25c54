"""Argparse types and cross-flag checks of the ``kvpilot operator`` commands (``cli``, ``activator``,
``fetch``): a bad value is a ``kvpilot operator <command>: error: ...`` line and exit 2 before anything
starts, never a traceback from Kopf, aiohttp or httpx later.
"""

from __future__ import annotations

import argparse
import math
import re
import urllib.parse

from kvpilot.operator import model_source as ms
from kvpilot.operator.child_validation import DNS1123_LABEL

#: Kopf serves --liveness on this port when the URL names none (kopf/_core/engines/probing.py)
KOPF_LIVENESS_DEFAULT_PORT = 80
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
_FETCHED = tuple(re.compile(p, re.ASCII) for p in (ms.HTTP_PATTERN, ms.S3_PATTERN, ms.HF_PATTERN))


def _split(text: str) -> tuple[urllib.parse.SplitResult, int | None]:
    """The URL's parts and port; ValueError for a port out of range or an unparsable host."""
    parts = urllib.parse.urlsplit(text)
    return parts, parts.port


def tcp_port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a TCP port (1-65535), got {text!r}") from None
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"expected a TCP port (1-65535), got {port}")
    return port


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def dns_label(text: str) -> str:
    """A namespace or Service name (RFC 1123 label): it goes into API paths and label selectors."""
    if len(text) > 63 or not DNS1123_LABEL.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected a DNS label (lowercase a-z, 0-9 and '-'), got {text!r}")
    return text


def image_ref(text: str) -> str:
    """--engine-image: a non-empty reference without spaces (the API server refuses an empty image, a
    registry any space)."""
    if not text or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(
            f"expected an image reference like ghcr.io/org/kvpilot:1.0, got {text!r}"
        )
    return text


def liveness_url(text: str) -> str:
    """Kopf's --liveness endpoint: http://HOST[:PORT]/PATH. Kopf raises on any other scheme only once its
    event loop runs; a port out of range was a ValueError traceback."""
    expected = f"expected an http://HOST:PORT/PATH URL like http://0.0.0.0:8080/healthz, got {text!r}"
    try:
        parts, port = _split(text)
    except ValueError as error:  # "Port out of range 0-65535", "Invalid IPv6 URL", ...
        raise argparse.ArgumentTypeError(f"{expected} ({error})") from None
    if parts.scheme != "http" or not parts.hostname or not parts.path.startswith("/"):
        raise argparse.ArgumentTypeError(expected)
    if parts.query or parts.fragment or parts.username or parts.password:
        raise argparse.ArgumentTypeError(f"{expected} (Kopf would ignore its query, fragment or user)")
    if port == 0:
        raise argparse.ArgumentTypeError(f"{expected} (port 0)")
    return text


def liveness_port(url: str) -> int:
    return urllib.parse.urlsplit(url).port or KOPF_LIVENESS_DEFAULT_PORT


def run_flags_problem(args: argparse.Namespace) -> str | None:
    """What ``kvpilot operator run``'s flags contradict, if anything."""
    if args.metrics_port is not None and args.liveness and args.metrics_port == liveness_port(args.liveness):
        # Both listen on every address of the pod (prometheus_client binds 0.0.0.0): the second would fail.
        return (
            f"--metrics-port {args.metrics_port} is the port of --liveness {args.liveness}: the operator "
            "cannot listen on both; pick another port for one of them"
        )
    return None


def fetched_source(text: str) -> str:
    """``fetch-model --source``: a source the init container downloads, in the form the CRD admits."""
    if not any(pattern.match(text) for pattern in _FETCHED):
        raise argparse.ArgumentTypeError(
            f"expected a fetched model source (http(s)://…/<file>.gguf, s3://<bucket>/<key>.gguf, "
            f"hf://<org>/<name>[@<revision>][/<file>.gguf]), got {text!r}"
        )
    if text.startswith(("http://", "https://")):
        try:
            _split(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
    return text


def sha256_hex(text: str) -> str:
    if not _SHA256.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected 64 hexadecimal digits, got {text!r}")
    return text.lower()


def endpoint_url(text: str) -> str:
    """An S3-compatible or Hugging Face endpoint: http(s)://HOST[:PORT][/PATH]."""
    try:
        parts, _ = _split(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL, got {text!r}")
    return text
