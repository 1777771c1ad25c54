"""bench/router_bench.py: its CPU-list argument, and a whole run against its null engines with the router
pinned apart from them (the placement the results file uses to measure the router's own cost)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
from bench_scripts import BENCH, bench_script

router_bench = bench_script("router_bench")


def test_cpu_lists_parse_to_exact_sets_and_bad_ones_are_argument_errors():
    assert router_bench.parse_cpus("") is None
    assert router_bench.parse_cpus("0") == {0}
    if len(os.sched_getaffinity(0)) >= 2:
        assert router_bench.parse_cpus("0-1") == {0, 1} == router_bench.parse_cpus("1,0")
    for bad in ("x", "0-", "1-0", str(max(os.sched_getaffinity(0)) + 1)):
        with pytest.raises(argparse.ArgumentTypeError):
            router_bench.parse_cpus(bad)


@pytest.mark.parametrize("idle, nice", [(True, 0), (False, 5)])
def test_engine_placement_sets_the_childs_policy_and_niceness(idle, nice):
    report = "import os; print(os.sched_getscheduler(0) == os.SCHED_IDLE, os.nice(0))"
    out = subprocess.run(
        [sys.executable, "-c", report],
        capture_output=True,
        text=True,
        check=True,
        preexec_fn=router_bench.placement(nice, None, idle),
    ).stdout
    assert out.split() == [str(idle), str(os.nice(0) + nice)]
    assert router_bench.placement(0, None) is None


def test_router_placement_asks_for_round_robin_real_time_where_this_user_may():
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        preexec_fn=router_bench.placement(0, None, realtime=True),
    )
    try:
        try:  # what this user may do decides what the child must have
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(os.sched_get_priority_min(os.SCHED_RR)))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            expected = "rr"
        except PermissionError:
            expected = "other"
        assert router_bench.policy_name(child.pid) == expected
    finally:
        child.communicate(b"")


def test_metrics_delta_counts_what_happened_in_between():
    before = '# HELP x_total X\nx_total 3.0\nh_bucket{le="0.001"} 2.0\nh_bucket{le="+Inf"} 2.0\n'
    after = '# HELP x_total X\nx_total 10.0\nh_bucket{le="0.001"} 5.0\nh_bucket{le="+Inf"} 9.0\ny 1.5\n'
    delta = router_bench.metrics_delta(before, after)
    assert (
        delta == '# HELP x_total X\nx_total 7.0\nh_bucket{le="0.001"} 3.0\nh_bucket{le="+Inf"} 7.0\ny 1.5\n'
    )
    assert router_bench.histogram_quantile(delta, "h", 0.99) == float("inf")  # 4 of the 7 above 1 ms
    assert router_bench.histogram_quantile(delta, "h", 0.4) == 0.001


def test_a_null_engine_run_with_the_router_pinned_reports_every_policy(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    router_cpu, engine_cpu = str(cpus[-1]), str(cpus[0])
    result = subprocess.run(
        [
            sys.executable,
            str(BENCH / "router_bench.py"),
            "--engine",
            "null",
            "--policies",
            "round_robin,cache_aware",
            "--num-requests",
            "8",
            "--request-rate",
            "20",
            "--num-tenants",
            "2",
            "--system-prompt-len",
            "40",
            "--engine-cpus",
            engine_cpu,
            "--router-cpus",
            router_cpu,
            "--output-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows: dict[str, str] = {}  # each policy's table row (its first line; the ratio lines come later)
    for line in result.stdout.splitlines():
        if line.split() and line.split()[0] in ("direct", "round_robin", "cache_aware"):
            rows.setdefault(line.split()[0], line)
    assert set(rows) == {"direct", "round_robin", "cache_aware"}
    assert "'fallback': 8" in rows["round_robin"]  # the 8 measured requests (not the 2 of the warm-up)
    assert "affinity" in rows["cache_aware"] and "cold" in rows["cache_aware"]
    assert "routing overhead p99 <= 5 ms:" in result.stdout
    assert "routing overhead p50 <= 1% of TTFT p50" in result.stdout
    assert "slowest warm-up window ≤" in result.stdout
    warm = (tmp_path / "cache_aware-router-warmup.metrics").read_text()
    assert router_bench.sample_value(warm, 'kvpilot_router_decisions_total{policy="cache_aware"') == 2


def test_a_bench_serve_that_fails_stops_the_run_with_its_message(tmp_path, closed_port):
    args = argparse.Namespace(
        warmup_requests=1,
        seed=0,
        request_rate="1",
        num_requests=2,
        num_tenants=2,
        system_prompt_len=10,
        input_len="4:8",
        output_len="2:4",
        engine_cpus=None,
    )
    with pytest.raises(SystemExit) as stop:  # was a CalledProcessError traceback
        router_bench.bench_serve(args, f"http://127.0.0.1:{closed_port}", tmp_path / "load.json")
    message = str(stop.value.code)
    assert message.startswith(f"router bench: `kvpilot bench serve` against http://127.0.0.1:{closed_port}")
    assert "exited with code 1" in message and "cannot reach the endpoint" in message


def test_the_report_marks_a_policy_whose_requests_failed(capsys):
    row = {
        "policy": "round_robin",
        "ttft_p50": 0.1,
        "ttft_p99": 0.2,
        "rps": 1.0,
        "out_tps": 10.0,
        "overhead_p50": None,
        "overhead_p99": None,
        "cpu_per_request": None,
        "cached": None,
        "decisions": {"fallback": 8},
        "failed": 3,
        "requests": 8,
    }
    router_bench.report([row, {**row, "policy": "cache_aware", "failed": 0}])
    out = capsys.readouterr().out
    assert "FAILED: 3 of 8 round_robin requests failed" in out
    assert "cache_aware requests failed" not in out
