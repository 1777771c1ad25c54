"""Security: request bodies are bounded in time as well as size (slowloris): a body that stops arriving gets
408 after ``--body-read-timeout``, and the server keeps serving others."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from polling import wait_until

from kvpilot.engine.server.config import ServerConfig, WarmupBucket


def test_security_a_stalled_body_gets_408_and_others_are_served(start_in_process):
    server = start_in_process(
        {"num_kv_blocks": 64}, ServerConfig(body_read_timeout_s=0.3, warmup_buckets=(WarmupBucket(1, 8),))
    )
    address = urlsplit(server.url)
    with socket.create_connection((address.hostname, address.port), timeout=5) as stalled:
        stalled.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt": '
        )
        start = time.monotonic()
        reply = b""
        while chunk := stalled.recv(4096):  # the server closes after its answer (the body is unread)
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - start < 3
        assert b'"code":"request_timeout"' in reply.replace(b" ", b"")
        assert b'"type":"invalid_request_error"' in reply.replace(b" ", b"")
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
    assert ok.status_code == 200


def _metric(server, name: str) -> float:
    """The sum of ``name``'s samples over all its labels."""
    lines = httpx.get(server.url + "/metrics", timeout=10).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith((name + "{", name + " ")))


def test_a_client_that_leaves_before_its_body_arrived_is_counted_not_refused(start_in_process):
    """A disconnect before the request reaches the engine is counted as abandoned; the partial body is not
    parsed into a 400 that nobody reads."""
    server = start_in_process({"num_kv_blocks": 64}, ServerConfig(warmup_buckets=(WarmupBucket(1, 8),)))
    address = urlsplit(server.url)
    with socket.create_connection((address.hostname, address.port), timeout=5) as leaving:
        leaving.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt": '
        )
    wait_until(lambda: _metric(server, "kvpilot_requests_abandoned_total") == 1, what="the abandoned count")
    assert _metric(server, "kvpilot_requests_rejected_total") == 0  # no error response for it


def test_security_a_stalled_request_head_gets_408_too(start_in_process):
    """A head (request line, headers) that starts and stops arriving is timed out as a body is: uvicorn
    itself times out only idle connections, and one trickling a head never is."""
    server = start_in_process(
        {"num_kv_blocks": 64}, ServerConfig(body_read_timeout_s=0.3, warmup_buckets=(WarmupBucket(1, 8),))
    )
    address = urlsplit(server.url)
    with socket.create_connection((address.hostname, address.port), timeout=5) as stalled:
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        start = time.monotonic()
        reply = b""
        while chunk := stalled.recv(4096):  # the server closes after its answer
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - start < 3
    assert b'"code":"request_timeout"' in reply and b"request head" in reply
    assert b'"type":"invalid_request_error"' in reply
    # a keep-alive connection that sends nothing is idle, not stalled: it is not answered
    with (
        socket.create_connection((address.hostname, address.port), timeout=1) as idle,
        pytest.raises(TimeoutError),
    ):
        idle.recv(1)


def test_a_body_refused_unread_as_too_large_closes_its_connection(start_in_process):
    """A declared Content-Length beyond --max-body-bytes gets 413 and the connection closes: kept open, the
    server would wait for (or read and drop) a body it has refused."""
    server = start_in_process(
        {"num_kv_blocks": 64}, ServerConfig(max_body_bytes=1024, warmup_buckets=(WarmupBucket(1, 8),))
    )
    address = urlsplit(server.url)
    with socket.create_connection((address.hostname, address.port), timeout=5) as client:
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000000\r\n\r\n{"
        )
        start = time.monotonic()
        reply = b""
        while chunk := client.recv(4096):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413") and time.monotonic() - start < 3
    assert b'"code":"request_too_large"' in reply.replace(b" ", b"")
