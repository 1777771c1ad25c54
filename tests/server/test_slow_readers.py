"""Security: a client that stops reading holds a bounded number of bytes in the server, in bytes — its
stream's chunk queue, the connection's write buffer and the kernel's send buffer together stay within
``--stream-buffer-bytes`` (plus the chunk in progress) — then loses its request after
``--backpressure-timeout`` (KV blocks freed; an error event if it reads again), and a client that never
reads again loses its connection after ``--write-stall-timeout``
(docs/architecture.md#backpressure-and-cancellation). The client reads part of a long stream fast first,
so the kernel would have grown its send buffer (to MBs on loopback) were it not fixed."""

from __future__ import annotations

import itertools

import httpx
from polling import wait_until
from stalled_reader import LARGE_STREAM_REQUEST, StalledReader, produced_through

from kvpilot.engine.server.config import ServerConfig, WarmupBucket

BUDGET = 64 << 10
REQUEST = LARGE_STREAM_REQUEST  # ~270 KB: without the bounds most of it would sit in buffers


def _metric(url: str, name: str) -> float:
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith((name + "{", name + " ")))


def _load(url: str) -> dict:
    return httpx.get(url + "/load", timeout=10).json()


def _all_free(url: str) -> bool:
    load = _load(url)  # free blocks include the cached ones (reusable, no request holds them)
    return load["running"] == 0 and load["kv_blocks_free"] == load["kv_blocks_total"]


def _serve(start_in_process, **config):
    return start_in_process(
        {"num_kv_blocks": 128},
        ServerConfig(warmup_buckets=(WarmupBucket(1, 8),), stream_buffer_bytes=BUDGET, **config),
    )


def test_security_a_stalled_reader_holds_at_most_the_byte_budget_then_loses_its_request(start_in_process):
    server = _serve(start_in_process, backpressure_timeout_s=2.5)  # room to see the pause
    client = StalledReader(server.url, "/v1/completions", REQUEST)
    try:
        client.read(100_000)  # fast at first: the kernel would grow an unset send buffer meanwhile
        wait_until(lambda: _load(server.url)["backpressured"] == 1, what="the request to pause")
        generated = _metric(server.url, "kvpilot_generation_tokens_total")
        consumed, queued = len(client.received), client.queued
        # paused, then cancelled for not reading: its blocks come back while the client still reads nothing
        wait_until(lambda: _all_free(server.url), what="the cancelled request's blocks")
        client.read_to_end()
    finally:
        client.close()
    events = client.events()
    assert events[-1].data == "[DONE]" and events[-2].data["error"]["code"] == "client_too_slow"
    # a token whose text was held back when the request was cancelled was never sent
    produced = produced_through(events, int(generated), held_back=4 * REQUEST["n"])
    largest = max(b.end - a.end for a, b in itertools.pairwise(events))
    held = produced - consumed - queued  # what the server held: queue, write buffer, socket buffer
    assert 0 < held <= BUDGET + (2 * REQUEST["n"] + 1) * largest, (held, produced, consumed, queued)
    assert generated < 2 * REQUEST["max_tokens"]  # it paused before the end (~600 KB)


def test_security_a_reader_that_never_reads_again_loses_its_connection(start_in_process):
    """No backpressure timeout: only the stalled connection's close cancels the request."""
    server = _serve(start_in_process, backpressure_timeout_s=0, write_stall_timeout_s=1.0)
    client = StalledReader(server.url, "/v1/completions", REQUEST)
    try:
        client.read(100_000)
        wait_until(lambda: _load(server.url)["backpressured"] == 1, what="the request to pause")
        wait_until(lambda: _all_free(server.url), timeout_s=20, what="the closed connection's request freed")
        client.read_to_end()
    finally:
        client.close()
    assert client.reset and not client.received.endswith(b"0\r\n\r\n")  # cut, not ended
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
    assert ok.status_code == 200
