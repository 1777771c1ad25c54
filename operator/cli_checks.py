"""Argparse types and cross-flag checks of the ``kvpilot operator`` commands (``cli``): a bad value is a
``kvpilot operator <command>: error: ...`` line and exit 2 before anything starts, never a traceback from
Kopf or aiohttp later.
"""

from __future__ import annotations

import argparse
import urllib.parse

#: Kopf serves --liveness on this port when the URL names none (kopf/_core/engines/probing.py)
KOPF_LIVENESS_DEFAULT_PORT = 80


def _split(text: str) -> tuple[urllib.parse.SplitResult, int | None]:
    """The URL's parts and port; ValueError for a port out of range or an unparsable host."""
    parts = urllib.parse.urlsplit(text)
    return parts, parts.port


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
