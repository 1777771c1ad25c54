"""bench/loopback_send.py: its report line, exactly, and a short run against a tiny engine."""

from __future__ import annotations

import subprocess
import sys

from bench_scripts import BENCH, bench_script

loopback_send = bench_script("loopback_send")


def test_the_report_counts_slow_sends_and_their_share_of_run_queue_wait():
    samples = [(0.1, 0.0), (0.2, 0.0), (3.0, 2.7), (1.0, 0.5), (5.0, 4.8)]
    assert loopback_send.report(samples, "engine other, sender other") == (
        "engine other, sender other: send ms p50 1.000 p90 5.000 p99 5.000 max 5.000; > 1 ms: 2 of 5, "
        "of their time on the run queue: 94%"
    )  # (2.7 + 4.8) / (3.0 + 5.0); exactly 1 ms is not slow
    assert (
        loopback_send.report([(0.3, 0.0)], "x")
        == "x: send ms p50 0.300 p90 0.300 p99 0.300 max 0.300; > 1 ms: 0 of 1"
    )


def test_a_short_run_against_a_tiny_engine_prints_one_report_line(tiny_model_dir):
    result = subprocess.run(
        [
            sys.executable,
            str(BENCH / "loopback_send.py"),
            "--model",
            str(tiny_model_dir),
            "--engine-args",
            "",
            "--sends",
            "4",
            "--interval",
            "0.01",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = result.stdout.splitlines()
    assert line.startswith("engine other, sender other: send ms p50 ") and " of 4" in line
