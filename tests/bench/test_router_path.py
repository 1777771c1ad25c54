"""bench/router_path.py: its report lines, exactly, and a short run against the tiny model."""

from __future__ import annotations

import subprocess
import sys

from bench_scripts import BENCH, bench_script

router_path = bench_script("router_path")


def test_the_report_gives_each_stage_by_decision_reason():
    times = {
        "cold": {"parse": [0.1], "profile": [0.9], "pick": [0.3], "total": [1.3]},
        "affinity": {
            "parse": [0.05, 0.07, 0.3],
            "profile": [0.2, 0.4, 0.3],
            "pick": [0.1, 0.2, 0.3],
            "total": [0.35, 0.67, 0.9],
        },
    }
    assert router_path.report(times) == [
        "affinity (3): parse p50 0.070 max 0.300, profile p50 0.300 max 0.400, pick p50 0.200 max 0.300, "
        "total p50 0.670 max 0.900",
        "cold (1): parse p50 0.100 max 0.100, profile p50 0.900 max 0.900, pick p50 0.300 max 0.300, "
        "total p50 1.300 max 1.300",
    ]


def test_a_short_run_routes_each_tenant_cold_once_then_with_affinity(tiny_model_dir):
    times = router_path.measure(str(tiny_model_dir), requests=30, gap_s=0.0, seed=0)
    assert set(times) == {"cold", "affinity"}
    assert len(times["cold"]["total"]) + len(times["affinity"]["total"]) == 30
    assert len(times["cold"]["total"]) <= 12  # at most one cold decision per tenant


def test_the_script_runs_with_a_hog(tiny_model_dir):
    result = subprocess.run(
        [
            sys.executable,
            str(BENCH / "router_path.py"),
            "--model",
            str(tiny_model_dir),
            "--requests",
            "4",
            "--gap-ms",
            "1",
            "--hog",
            "--cpu",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith(("affinity (", "cold (")) and "total p50 " in result.stdout
