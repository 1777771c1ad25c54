"""``bench/kernels.py --quick`` runs end to end (on CPU: the Triton interpreter) and its numbers are sane."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.triton

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "kernels.py"
ROW = re.compile(
    r"^(decode|prefill) +(B=.*?) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) (GB/s|TFLOP/s) +([\d.]+) +(\S+)"
)


def test_quick_kernel_bench_runs_and_agrees_with_sdpa():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--max-err", "5e-3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [ROW.match(line) for line in result.stdout.splitlines()]
    rows = [row for row in rows if row]
    assert [row.group(1) for row in rows] == ["decode", "decode", "prefill"], result.stdout
    for row in rows:
        triton_ms, sdpa_ms, max_err = float(row.group(3)), float(row.group(4)), float(row.group(9))
        assert triton_ms > 0 and sdpa_ms > 0
        assert max_err <= 5e-3
        assert row.group(7) == ("GB/s" if row.group(1) == "decode" else "TFLOP/s")
    # the long quick decode goes through split-KV and the merge kernel
    assert "splits=2" in result.stdout
    # the mixed batch: the per-batch rule splits every sequence in 2, the per-sequence plan only the long
    # one, in 3 splits of >= 256 keys; both give the same attention
    mixed = re.search(
        r"^mixed .*per-batch splits 2 [\d.]+ ms, per-sequence splits <= 3 of >= 256 keys [\d.]+ ms, "
        r"ratio [\d.]+, max_err (\S+)$",
        result.stdout,
        re.M,
    )
    assert mixed, result.stdout
    assert float(mixed.group(1)) <= 1e-5
