"""How long a router's ``send()`` of one request to a co-located engine takes, and why: the measurement behind
``router_bench.py``'s ``--router-sched rr`` default.

It starts one ``kvpilot serve`` (placed like router_bench's engines: ``--engine-sched idle`` or ``other`` at
``--engine-nice``), keeps it prefilling new prompts from a background thread, and from this process writes
``--sends`` chat requests (~8 KB: a 900-word system prompt) on fresh connections, timing each ``send()`` and
reading this thread's ``/proc/thread-self/schedstat`` around it. Over loopback the sender's system call runs
the receiver's network stack and wakes its server; the run-queue wait of a slow send shows the sender was
preempted there rather than working. ``--sender-sched rr`` runs the sending thread under ``SCHED_RR``.

    .venv/bin/python bench/loopback_send.py --engine-sched other --sender-sched other
    .venv/bin/python bench/loopback_send.py --engine-sched other --sender-sched rr
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from router_bench import KVPILOT, Processes, free_port


def schedstat() -> tuple[int, int]:
    """This thread's time on a CPU and waiting on a run queue, in ns."""
    on_cpu, waiting, _ = Path("/proc/thread-self/schedstat").read_text().split()
    return int(on_cpu), int(waiting)


def keep_prefilling(url: str, model: str, stop: threading.Event) -> None:
    """New 300-word prompts back to back, so the engine is computing whenever a request arrives."""
    for i in range(10**9):
        if stop.is_set():
            return
        prompt = " ".join(f"b{i}_{j}" for j in range(300))
        request = urllib.request.Request(
            url + "/v1/completions",
            headers={"content-type": "application/json"},
            data=json.dumps({"model": model, "prompt": prompt, "max_tokens": 4}).encode(),
        )
        try:
            urllib.request.urlopen(request, timeout=120).read()
        except OSError:
            time.sleep(0.1)


def chat_request(model: str, index: int) -> bytes:
    system = " ".join(f"w{i}" for i in range(900))
    body = json.dumps(
        {
            "model": model,
            "max_tokens": 8,
            "stream": True,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"question {index} please"},
            ],
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


def measure(port: int, args: argparse.Namespace) -> list[tuple[float, float]]:
    """(send ms, run-queue wait ms during it) per request."""
    if args.sender_sched == "rr":
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(os.sched_get_priority_min(os.SCHED_RR)))
    samples, open_connections = [], []
    for index in range(args.sends):
        connection = socket.create_connection(("127.0.0.1", port))
        connection.setblocking(False)
        payload = chat_request(args.model, index)
        time.sleep(args.interval)
        before, start = schedstat(), time.perf_counter()
        connection.send(payload)
        elapsed, after = time.perf_counter() - start, schedstat()
        samples.append((elapsed * 1e3, (after[1] - before[1]) / 1e6))
        open_connections.append(connection)
        if len(open_connections) > 8:  # a few streams stay open, as at a router
            open_connections.pop(0).close()
    for connection in open_connections:
        connection.close()
    return samples


def report(samples: list[tuple[float, float]], label: str) -> str:
    times = sorted(ms for ms, _ in samples)
    slow = [(ms, wait) for ms, wait in samples if ms > 1.0]
    n = len(times)
    line = (
        f"{label}: send ms p50 {times[n // 2]:.3f} p90 {times[int(n * 0.9)]:.3f} "
        f"p99 {times[min(n - 1, int(n * 0.99))]:.3f} max {times[-1]:.3f}; > 1 ms: {len(slow)} of {n}"
    )
    if slow:
        line += (
            f", of their time on the run queue: "
            f"{sum(wait for _, wait in slow) / sum(ms for ms, _ in slow):.0%}"
        )
    return line


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--engine-args", default="--kv-cache-memory-bytes 200000000 --max-num-batched-tokens 512"
    )
    parser.add_argument("--engine-sched", choices=("idle", "other"), default="other")
    parser.add_argument("--engine-nice", type=int, default=10)
    parser.add_argument("--sender-sched", choices=("rr", "other"), default="other")
    parser.add_argument("--sends", type=int, default=300)
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between sends")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    args = parser.parse_args()
    if args.sends < 1:
        parser.error("--sends must be at least 1")
    with tempfile.TemporaryDirectory() as logs:
        processes = Processes(Path(logs))
        try:
            port = free_port()
            processes.start(
                "engine",
                [
                    KVPILOT,
                    "serve",
                    "--model",
                    args.model,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    *shlex.split(args.engine_args),
                ],
                env={"OMP_NUM_THREADS": "1"},
                nice=args.engine_nice,
                idle=args.engine_sched == "idle",
            )
            url = f"http://127.0.0.1:{port}"
            processes.wait_ready(url + "/ready", args.ready_timeout)
            stop = threading.Event()
            threading.Thread(target=keep_prefilling, args=(url, args.model, stop), daemon=True).start()
            samples = measure(port, args)
            stop.set()
        finally:
            processes.stop_all()
    print(report(samples, f"engine {args.engine_sched}, sender {args.sender_sched}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
