"""Router benchmark: cache_aware vs least_loaded vs round_robin on a multi-tenant workload whose tenants share
long system prompts, with the same arrivals and prompts for every policy.

For each policy it starts fresh engine replicas (cold caches, so no policy inherits another's hits), one
``kvpilot router`` in front of them, drives the router with ``kvpilot bench serve --workload shared-prefix``,
scrapes the router's ``/metrics``, and stops everything. It prints each policy's TTFT, throughput, routing
overhead and decisions, the ratios to round_robin, and the targets (TTFT p50 ≤ 1/3 of round robin's,
throughput ≥ round robin's, routing overhead p50 ≤ 1 % of cache_aware's TTFT p50 and p99 ≤ 5 ms).

Engines (``--engine``):
- ``serve``: ``kvpilot serve --model M`` replicas, the real measurement;
- ``null``: this script's null engine (``--null-engine PORT``): speaks the engine ⇄ router contract, answers
  at once, caches the blocks of every prompt it receives. Latency through it is the router's own cost
  (compare the ``direct`` row, the same load sent straight to one null engine), and it exercises the whole
  pipeline without a model.

The routing overhead is the router's ``kvpilot_router_routing_overhead_seconds`` histogram (arrival →
upstream request going out) over the measured requests; its quantiles are reported as bucket upper bounds
("≤"). Before the measured load each fresh router and its engines get ``--warmup-requests`` requests one at
a time (tenants of another seed), excluded from every figure as bench serve excludes its warm-up (a fresh
process pays one-time costs on its first requests). The slowest warm-up window is printed beside the
targets. On a host shared with
the engines and the load generator that wall time includes waiting for a core, so the router's CPU time per
request (its whole work: polls, routing, relaying) is printed too.

Placement on one small host: each engine runs with ``OMP_NUM_THREADS=--engine-threads`` (three 2-thread
engines on 2 cores thrash each other) and, by default, under ``SCHED_IDLE`` (``--engine-sched idle``): the
engines take every cycle the router and the load generator leave, but never make them wait for a core, as a
deployment that gives the router its own CPU would not. (A nice level is not enough under the kernel's
EEVDF scheduler: a 10 ms sleeper's wake-up latency next to three nice-10 busy loops measured p99 2.8 ms here,
next to three SCHED_IDLE ones 0.18 ms.) ``--engine-sched other --engine-nice N`` gives the older placement.
The router runs under ``SCHED_RR`` where permitted (``--router-sched rr``): writing a request to an engine
over loopback wakes that engine's server in the middle of the router's ``send()``, and a woken task of the
normal policy preempts the router there: 8 KB sends to a nice-10 engine took > 1 ms in 73 of 300 tries
(max 6.8 ms, nearly all of it waiting on the run queue), under ``SCHED_RR`` in none (max 0.29 ms)
(``bench/loopback_send.py``). With its own CPU a router would not wait like that.
``--engine-cpus`` / ``--router-cpus`` pin them apart (e.g. ``--engine-cpus 0 --router-cpus 1`` with
``--engine null`` gives the router a core of its own).

Measured figures and the commands that produced them: ``bench/results/router_bench.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

KVPILOT = str(Path(sys.executable).with_name("kvpilot"))
OVERHEAD = "kvpilot_router_routing_overhead_seconds"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, ""
    except OSError:
        return 0, ""


def parse_cpus(text: str) -> set[int] | None:
    """``"0"``, ``"0,2"`` or ``"0-3"`` → CPU ids; ``""`` → None (no pinning). An argparse type."""
    if not text:
        return None
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, dash, high = part.partition("-")
            cpus.update(range(int(low), int(high if dash else low) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a CPU list such as 0, 0,2 or 0-3, got {text!r}") from None
    available = os.sched_getaffinity(0)
    if not cpus or not cpus <= available:
        raise argparse.ArgumentTypeError(
            f"CPU list {text!r} is not within this process's CPUs {sorted(available)}"
        )
    return cpus


def placement(nice: int, cpus: set[int] | None, idle: bool = False, realtime: bool = False):
    """A ``preexec_fn`` that sets a child's niceness, CPU affinity and policy: ``idle`` → ``SCHED_IDLE``,
    ``realtime`` → ``SCHED_RR`` at the lowest real-time priority where this user may (kept as it was where
    not; :func:`policy_name` tells). None when there is nothing to set."""
    if not nice and cpus is None and not idle and not realtime:
        return None

    def apply() -> None:
        if nice:
            os.nice(nice)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        if idle:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        if realtime:
            with contextlib.suppress(PermissionError):
                os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(os.sched_get_priority_min(os.SCHED_RR)))

    return apply


def policy_name(pid: int) -> str:
    return {os.SCHED_OTHER: "other", os.SCHED_IDLE: "idle", os.SCHED_RR: "rr"}.get(
        os.sched_getscheduler(pid), "?"
    )


class Processes:
    """Child processes with their logs; all stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.running: list[tuple[subprocess.Popen, Path]] = []

    def start(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        nice: int = 0,
        cpus: set[int] | None = None,
        idle: bool = False,
        realtime: bool = False,
    ) -> subprocess.Popen:
        log = self.log_dir / f"{name}.log"
        process = subprocess.Popen(
            argv,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            preexec_fn=placement(nice, cpus, idle, realtime),
        )
        self.running.append((process, log))
        return process

    def wait_ready(self, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while http_get(url)[0] != 200:
            for process, log in self.running:
                if process.poll() is not None:
                    raise SystemExit(
                        f"{process.args[:3]} exited ({process.returncode}); log {log}:\n"
                        + log.read_text()[-2000:]
                    )
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} not ready after {timeout_s:.0f}s")
            time.sleep(0.2)

    def stop_all(self) -> None:
        for process, _ in self.running:
            process.terminate()
        for process, _ in self.running:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.running.clear()


def engine_argv(args: argparse.Namespace, port: int) -> list[str]:
    if args.engine == "null":
        return [sys.executable, __file__, "--null-engine", str(port), "--model", args.model]
    serve_help = subprocess.run([KVPILOT, "serve", "--help"], capture_output=True, text=True).stdout
    host = ["--host", "127.0.0.1"] if "--host" in serve_help else []
    return [
        KVPILOT,
        "serve",
        "--model",
        args.model,
        *host,
        "--port",
        str(port),
        *shlex.split(args.engine_args),
    ]


def bench_serve(args: argparse.Namespace, base_url: str, output: Path, warmup: bool = False) -> dict:
    """The measured load, or (``warmup``) ``--warmup-requests`` requests one at a time, of another seed's
    tenants: they warm the processes (the router's word cache, the engines' kernels), not the measured
    tenants' prefixes."""
    load = (
        ["--max-concurrency", "1", "--num-requests", str(args.warmup_requests), "--seed", str(args.seed + 1)]
        if warmup
        else [
            "--request-rate",
            args.request_rate,
            "--num-requests",
            str(args.num_requests),
            "--seed",
            str(args.seed),
        ]
    )
    argv = [
        KVPILOT,
        "bench",
        "serve",
        "--base-url",
        base_url,
        "--api",
        "chat",
        "--workload",
        "shared-prefix",
        "--num-tenants",
        str(args.num_tenants),
        "--system-prompt-len",
        str(args.system_prompt_len),
        "--input-len",
        args.input_len,
        "--output-len",
        args.output_len,
        *load,
        "--warmup-requests",
        "0",
        "--ignore-eos",
        # every policy gets the same requests, and the probes of a context fit would count in the router's
        # figures: lengths the model cannot hold fail the run (bench serve exits 3) instead of shrinking
        "--no-context-fit",
        "--output-json",
        str(output),
        "--no-progress",
    ]
    log = output.with_suffix(".log")
    with log.open("w") as stderr:
        code = subprocess.run(
            argv, stdout=subprocess.DEVNULL, stderr=stderr, preexec_fn=placement(0, args.engine_cpus)
        ).returncode
    if code != 0:
        raise SystemExit(
            f"router bench: `kvpilot bench serve` against {base_url} exited with code {code}; {log}:\n"
            + log.read_text()[-2000:]
        )
    return json.loads(output.read_text())["points"][0]["summary"]


def histogram_quantile(metrics: str, name: str, q: float) -> float | None:
    """Upper bound of the bucket holding quantile ``q`` of a Prometheus text-format histogram."""
    buckets = []
    for line in metrics.splitlines():
        if line.startswith(name + "_bucket{"):
            bound = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if bound == "+Inf" else float(bound), float(line.rsplit(" ", 1)[1])))
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    return next(bound for bound, count in sorted(buckets) if count >= q * total)


def metrics_delta(before: str, after: str) -> str:
    """``after`` with each sample less its value in ``before`` (counters and histograms over the requests in
    between; comments and samples only ``after`` has are kept as they are)."""
    earlier = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in before.splitlines()
        if line and not line.startswith("#")
    }
    lines = []
    for line in after.splitlines():
        if line and not line.startswith("#"):
            sample, value = line.rsplit(" ", 1)
            line = f"{sample} {float(value) - earlier.get(sample, 0.0)}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc): the router's cost, whatever else shares the host."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sample_value(metrics: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(prefix))


def run_policy(args: argparse.Namespace, policy: str | None, out: Path) -> dict:
    """Fresh engines, a router of ``policy`` (None: straight to the first engine), the load, the figures."""
    processes = Processes(out)
    tag = policy or "direct"
    try:
        ports = [free_port() for _ in range(args.replicas if policy else 1)]
        for i, port in enumerate(ports):
            processes.start(
                f"{tag}-engine{i}",
                engine_argv(args, port),
                env={"OMP_NUM_THREADS": str(args.engine_threads)},
                nice=args.engine_nice,
                cpus=args.engine_cpus,
                idle=args.engine_sched == "idle",
            )
        for port in ports:
            processes.wait_ready(f"http://127.0.0.1:{port}/ready", args.ready_timeout)
        base_url, metrics, warm, router, cpu = f"http://127.0.0.1:{ports[0]}", "", "", None, None
        if policy:
            router_port = free_port()
            router = processes.start(
                f"{tag}-router",
                [
                    KVPILOT,
                    "router",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(router_port),
                    "--policy",
                    policy,
                    "--model",
                    args.model,
                    "--replicas",
                    ",".join(f"http://127.0.0.1:{p}" for p in ports),
                    *(["--weights", args.weights] if args.weights else []),
                ],
                cpus=args.router_cpus,
                realtime=args.router_sched == "rr",
            )
            if args.router_sched == "rr" and policy_name(router.pid) != "rr":
                print(
                    "  (no permission for SCHED_RR: the router runs under the normal policy)", file=sys.stderr
                )
            base_url = f"http://127.0.0.1:{router_port}"
            processes.wait_ready(base_url + "/ready", 60)
        if args.warmup_requests:
            bench_serve(args, base_url, out / f"{tag}-warmup.json", warmup=True)
        warm = http_get(base_url + "/metrics")[1] if router else ""
        cpu_before = (
            cpu_seconds(router.pid) if router else 0.0
        )  # after that scrape: its CPU is not per request
        summary = bench_serve(args, base_url, out / f"{tag}.json")
        if router:
            cpu = (cpu_seconds(router.pid) - cpu_before) / args.num_requests
            cumulative = http_get(base_url + "/metrics")[1]
            (out / f"{tag}-router.metrics").write_text(cumulative)  # every bucket, warm-up included
            (out / f"{tag}-router-warmup.metrics").write_text(warm)
            metrics = metrics_delta(warm, cumulative)  # the measured requests only
    finally:
        processes.stop_all()
    decisions = {
        reason: sample_value(
            metrics, f'kvpilot_router_decisions_total{{policy="{policy}",reason="{reason}"}}'
        )
        for reason in ("affinity", "load", "cold", "fallback")
    }
    prompt = sample_value(metrics, "kvpilot_router_prompt_tokens_total")
    return {
        "policy": tag,
        "ttft_p50": summary["ttft_s"]["p50"],
        "ttft_p99": summary["ttft_s"]["p99"],
        "rps": summary["request_throughput_rps"],
        "out_tps": summary["output_token_throughput_tps"],
        "overhead_p50": histogram_quantile(metrics, OVERHEAD, 0.5),
        "overhead_p99": histogram_quantile(metrics, OVERHEAD, 0.99),
        "cpu_per_request": cpu,
        "overhead_max": histogram_quantile(metrics, OVERHEAD, 1.0),
        "overhead_max_warmup": histogram_quantile(warm, OVERHEAD, 1.0),
        "cached": sample_value(metrics, "kvpilot_router_cached_prompt_tokens_total") / prompt
        if prompt
        else None,
        "decisions": {k: int(v) for k, v in decisions.items() if v},
        "failed": summary["requests_failed"],
        "requests": summary["requests_total"],
    }


def report(rows: list[dict]) -> None:
    def ms(value: float | None, bound: bool = False) -> str:
        return "-" if value is None else ("≤" if bound else "") + f"{value * 1000:.2f}"

    print(
        f"{'policy':<13}{'TTFT p50 ms':>12}{'TTFT p99 ms':>12}{'req/s':>8}{'out tok/s':>10}"
        f"{'ovh p50 ms':>11}{'ovh p99 ms':>11}{'CPU ms/req':>11}{'cached':>8}  decisions"
    )
    for r in rows:
        cached = "-" if r["cached"] is None else f"{r['cached']:.0%}"
        print(
            f"{r['policy']:<13}{ms(r['ttft_p50']):>12}{ms(r['ttft_p99']):>12}"
            f"{r['rps']:>8.2f}{r['out_tps']:>10.1f}"
            f"{ms(r['overhead_p50'], True):>11}{ms(r['overhead_p99'], True):>11}"
            f"{ms(r['cpu_per_request']):>11}"
            f"{cached:>8}  {r['decisions']}"
        )
    for r in rows:
        if r["failed"]:
            print(
                f"  FAILED: {r['failed']} of {r['requests']} {r['policy']} requests failed (their errors: "
                "the bench JSON); that row counts only the successful ones"
            )
    by_policy = {r["policy"]: r for r in rows}
    baseline = by_policy.get("round_robin")
    if baseline:
        print("\nratios to round_robin (TTFT p50: lower is better; throughput: higher is better)")
        for r in rows:
            if r["policy"] != "round_robin":
                print(
                    f"  {r['policy']:<13} TTFT p50 x{r['ttft_p50'] / baseline['ttft_p50']:.3f}   "
                    f"throughput x{r['rps'] / baseline['rps']:.3f}"
                )
    if "direct" in by_policy:
        for r in rows:
            if r["policy"] != "direct":
                print(
                    f"  {r['policy']:<13} TTFT p50 through the router / direct: "
                    f"x{r['ttft_p50'] / by_policy['direct']['ttft_p50']:.3f}"
                )
    aware = by_policy.get("cache_aware")
    if aware and baseline:
        print("\ntargets:")
        print(f"  TTFT p50 <= 1/3 of round robin's: {aware['ttft_p50'] <= baseline['ttft_p50'] / 3}")
        print(f"  throughput >= round robin's:      {aware['rps'] >= baseline['rps']}")
    if aware and aware["overhead_p99"] is not None:
        # bucket upper bounds: "≤ 5 ms" says 99 % of the windows ended within 5 ms (le="0.005")
        budget = aware["ttft_p50"] / 100  # 1 % of what users wait for their first token
        within = aware["overhead_p50"] <= budget
        print(f"  routing overhead p50 <= 1% of TTFT p50 ({budget * 1000:.2f} ms): {within}")
        print(f"  routing overhead p99 <= 5 ms:     {aware['overhead_p99'] <= 0.005}")
        # The warm-up's windows are not part of the figures above, as for every other figure of the bench.
        print(
            f"  (slowest measured window ≤{aware['overhead_max'] * 1000:.2f} ms; slowest warm-up window "
            + (
                "-"
                if aware["overhead_max_warmup"] is None
                else f"≤{aware['overhead_max_warmup'] * 1000:.2f} ms"
            )
            + ")"
        )


def run_null_engine(port: int, model: str) -> None:
    """A contract-complete engine that computes nothing: instant answers, a prefix cache of what it saw."""
    from aiohttp import web

    from kvpilot.engine.kv.block_hash import encode_extra_keys, root_hash
    from kvpilot.engine.model.registry import resolve_model
    from kvpilot.engine.prompt_render import completion_prompt_ids
    from kvpilot.engine.tenancy import tenant_from_headers
    from kvpilot.engine.tokenizer import Tokenizer
    from kvpilot.router.block_chain import BlockChain
    from kvpilot.router.segment_tokenizer import SegmentTokenizer

    # The router's exact token cache: the null engine must cost the shared host little.
    model_dir = resolve_model(model, progress=False)
    tokenizer = Tokenizer.from_dir(model_dir)
    segments, root, epoch = (
        SegmentTokenizer(tokenizer, model_dir),
        root_hash("null"),
        uuid.uuid4().hex,
    )
    cached: set[str] = set()
    events: list[dict] = []
    head = {"epoch": epoch, "root": root.hex(), "block_size": 16}

    async def load(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model": model,
                "epoch": epoch,
                "ready": True,
                "phase": "ready",
                "waiting": 0,
                "running": 0,
                "swapped": 0,
                "queued_prefill_tokens": 0,
                "running_decode_tokens": 0,
                "kv_blocks_total": 100000,
                "kv_blocks_free": 100000,
                "kv_blocks_cached": len(cached),
                "kv_blocks_reserved": 0,
                "kv_usage": 0.0,
                "block_size": 16,
                "max_num_seqs": 256,
                "max_num_batched_tokens": 8192,
                "prefill_tokens_per_second": 0.0,
                "decode_step_seconds": 0.0,
            }
        )

    async def kv_events(request: web.Request) -> web.Response:
        since = int(request.query.get("since", "0"))
        return web.json_response(
            {**head, "seq": len(events), "gap": since > len(events), "events": events[since:]}
        )

    async def kv_snapshot(request: web.Request) -> web.Response:
        return web.json_response({**head, "seq": len(events), "block_hashes": sorted(cached)})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = "messages" in body
        ids = (
            segments.encode_rendered(tokenizer.apply_chat_template(body["messages"]))
            if chat
            else completion_prompt_ids(tokenizer, body["prompt"])
        )
        salt = encode_extra_keys(cache_salt=tenant_from_headers(request.headers))
        new = [h.hex() for h in BlockChain(ids, 16, root, salt).all_hashes() if h.hex() not in cached]
        if new:
            cached.update(new)
            events.append({"seq": len(events) + 1, "type": "stored", "block_hashes": new})
        choice = {"index": 0, "delta": {"content": "ok"}} if chat else {"index": 0, "text": "ok"}
        usage = {"prompt_tokens": len(ids), "completion_tokens": 1}
        payload = (
            f"data: {json.dumps({'choices': [choice]})}\n\n"
            f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        )
        return web.Response(text=payload + "data: [DONE]\n\n", content_type="text/event-stream")

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "phase": "ready"})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})

    app = web.Application()
    for path, handler in (
        ("/load", load),
        ("/kv/events", kv_events),
        ("/kv/snapshot", kv_snapshot),
        ("/health", ok),
        ("/ready", ok),
        ("/v1/models", models),
    ):
        app.router.add_get(path, handler)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--engine", choices=("serve", "null"), default="serve")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--policies", default="round_robin,least_loaded,cache_aware")
    parser.add_argument(
        "--engine-args",
        default="--kv-cache-memory-bytes 200000000 --max-num-batched-tokens 512",
        help="extra kvpilot serve flags (a KV cache that holds ~5 of the 12 tenants' system "
        "prompts makes them compete for it; a 512-token step budget chunks their prefills)",
    )
    parser.add_argument(
        "--engine-threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS per engine (replicas share this host's cores)",
    )
    parser.add_argument(
        "--engine-sched",
        choices=("idle", "other"),
        default="idle",
        help="scheduling policy of the engines: idle (SCHED_IDLE) runs them only when the "
        "router and the load generator - which a deployment gives their own CPU - do not "
        "need the core; other: the normal policy at --engine-nice",
    )
    parser.add_argument(
        "--engine-nice",
        type=int,
        default=10,
        help="niceness of the engines (what it means under --engine-sched idle: nothing)",
    )
    parser.add_argument(
        "--engine-cpus",
        type=parse_cpus,
        default=None,
        metavar="LIST",
        help="pin the engines and the load generator to these CPUs (e.g. 0 or 0-2)",
    )
    parser.add_argument(
        "--router-sched",
        choices=("rr", "other"),
        default="rr",
        help="scheduling policy of the router: rr (SCHED_RR at the lowest real-time priority, "
        "where permitted) keeps tasks it wakes - the engine it sends a request to, the load "
        "generator - from preempting it mid-send, as a router with its own CPU would not "
        "be; other: the normal policy",
    )
    parser.add_argument(
        "--router-cpus",
        type=parse_cpus,
        default=None,
        metavar="LIST",
        help="pin the router to these CPUs: a core of its own, as its Deployment would give it",
    )
    parser.add_argument("--weights", default="", help="router --weights for cache_aware")
    parser.add_argument("--num-tenants", type=int, default=12)
    parser.add_argument("--system-prompt-len", type=int, default=600, help="words per tenant system prompt")
    parser.add_argument("--input-len", default="32:96", help="user words MIN:MAX")
    parser.add_argument("--output-len", default="16:32", help="max_tokens MIN:MAX")
    parser.add_argument(
        "--request-rate",
        default="0.35",
        help="Poisson arrivals per second (3 SmolLM2 replicas on 2 cores saturate near 0.5/s "
        "without prefix hits; above that every policy only measures its queues)",
    )
    parser.add_argument("--num-requests", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--warmup-requests",
        type=int,
        default=2,
        help="requests sent one at a time through each fresh router and its engines before the "
        "measured load (tenants of seed + 1); excluded from every figure",
    )
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--output-dir", type=Path, help="logs and bench JSON (default: a temporary folder)")
    parser.add_argument("--null-engine", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.null_engine is not None:
        run_null_engine(args.null_engine, args.model)
        return 0
    if (
        args.engine == "serve"
        and subprocess.run([KVPILOT, "serve", "--help"], capture_output=True).returncode
    ):
        print("kvpilot serve is not available yet: nothing to benchmark (try --engine null)", file=sys.stderr)
        return 2
    out = args.output_dir or Path(tempfile.mkdtemp(prefix="router-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    print(
        f"router bench: {args.replicas} x {args.engine} ({args.model}), {args.num_tenants} tenants x "
        f"{args.system_prompt_len}-word system prompts, "
        f"{args.num_requests} requests at {args.request_rate}/s; "
        f"logs in {out}",
        flush=True,
    )
    rows = [run_policy(args, None, out)] if args.engine == "null" else []
    for policy in policies:
        rows.append(run_policy(args, policy, out))
        print(f"  {policy}: done", flush=True)
    report(rows)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
