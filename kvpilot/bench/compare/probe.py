"""How much fp32 GEMM the machine gives right now: a one-second probe run just before each system.

The load average says others are busy; this says what that costs. The probe multiplies a 256×576 by a
576×1536 fp32 matrix (this model's MLP shape at a decode batch of 256) on ``threads`` threads for about a
second and reports GFLOP/s, to set beside the ~120–135 GFLOP/s this kind of machine gives when quiet.
It runs in a child interpreter so this process never loads torch or holds OpenMP threads.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile

PROBE_TIMEOUT_S = 120.0
QUIET_GEMM_GFLOPS = 120.0  # the low end of the quiet machine's fp32 GEMM rate (the measurement)

_PROBE = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
a, b = torch.randn(256, 576), torch.randn(576, 1536)
for _ in range(20):
    a @ b
iters, start = 0, time.perf_counter()
while time.perf_counter() - start < float(sys.argv[2]):
    a @ b
    iters += 1
print(2 * 256 * 576 * 1536 * iters / (time.perf_counter() - start) / 1e9)
"""


def gemm_gflops(threads: int, env: dict[str, str], seconds: float = 1.0) -> float | None:
    """fp32 GEMM GFLOP/s available now, or None when the probe could not run (it never fails a run)."""
    try:
        result = subprocess.run(
            [sys.executable, "-c", _PROBE, str(threads), str(seconds)],
            capture_output=True,
            text=True,
            env=env,
            timeout=PROBE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            cwd=tempfile.gettempdir(),
        )  # not the repo root: operator/ shadows the stdlib
    except (subprocess.TimeoutExpired, OSError):
        return None
    try:
        return float(result.stdout.strip().splitlines()[-1]) if result.returncode == 0 else None
    except (ValueError, IndexError):
        return None
