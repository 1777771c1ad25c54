"""``bench/triton_host_time.py`` times the GPU decode path's Python with every launch stubbed."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.triton

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "triton_host_time.py"


def test_it_times_the_three_host_parts_of_a_decode_step():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--batch", "4", "--calls", "5"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = re.findall(
        r"^(prepare|attention forward|fused layer ops) \(per (step|layer)\) +([\d.]+) µs$",
        result.stdout,
        re.M,
    )
    assert [row[0] for row in rows] == ["prepare", "attention forward", "fused layer ops"], result.stdout
    assert all(float(row[2]) > 0 for row in rows)


def test_bad_flags_are_a_usage_error():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--calls", "0"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and "--calls must be >= 1" in result.stderr
