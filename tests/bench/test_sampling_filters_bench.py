"""``bench/sampling_filters.py --quick`` runs and prints a ratio for every case."""

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "sampling_filters.py"
ROW = re.compile(
    r"^128x512 +(.+?) +baseline +([\d.]+) ms +current +([\d.]+) ms +native +([\d.]+) ms +ratio +([\d.]+)"
    r" +native ratio +([\d.]+)$"
)


def test_quick_run_times_every_case_against_the_baseline():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [m for m in map(ROW.match, result.stdout.splitlines()) if m]
    assert [m.group(1) for m in rows] == ["T=0.8", "T=0.8 top_k=50 top_p=0.95", "T=0.8 top_p=0.9"], (
        result.stdout
    )
    assert all(all(float(m.group(i)) > 0 for i in range(2, 7)) for m in rows)


def test_sampled_decode_reports_each_case(tiny_model_dir):
    script = SCRIPT.parent / "sampled_decode.py"
    result = subprocess.run(
        [sys.executable, str(script), "x", "--model", "tiny-random", "--requests", "4", "--max-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = re.findall(r"^x +(.+?) +([\d.]+) output tok/s \(", result.stdout, re.M)
    assert [name for name, _ in rows] == ["temperature=1.0", "T=0.8 top_p=0.95 top_k=50", "greedy"]
    assert all(float(rate) > 0 for _, rate in rows)
