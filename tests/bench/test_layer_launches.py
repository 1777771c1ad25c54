"""``bench/layer_launches.py`` counts a decode step's launches per decoder layer on both paths."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.triton

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "layer_launches.py"


def test_the_fused_path_launches_one_kernel_per_elementwise_step():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    counts = dict(
        re.findall(
            r"^(plain PyTorch layer|fused path, Triton kernels) +([\d.]+) launches", result.stdout, re.M
        )
    )
    assert set(counts) == {"plain PyTorch layer", "fused path, Triton kernels"}, result.stdout
    # four projections, two norms with their adds, the activation, RoPE inside the K/V write, attention: 9
    assert float(counts["fused path, Triton kernels"]) == 9.0, result.stdout
    fused = result.stdout.split("fused path, Triton kernels")[1]
    for launch in (
        "triton:add_rms_norm 2",
        "triton:silu_mul 1",
        "triton:write_kv 1",
        "triton:paged_decode 1",
    ):
        assert launch in fused, result.stdout
    assert "rope_" not in fused, result.stdout  # no RoPE launch of its own
    # the plain layer's norms, rotate-half and activation are many small operators
    assert float(counts["plain PyTorch layer"]) >= 20, result.stdout
