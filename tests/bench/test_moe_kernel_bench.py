"""``bench/moe_kernel.py``: its baseline (transformers' eager per-expert loop) computes the engine's sorted
CPU path's output, for both shapes' routing, and a short run prints both timings and their ratio."""

from __future__ import annotations

import torch
from bench_scripts import bench_script

from kvpilot.engine.model.moe_experts import reference_moe, sorted_moe

moe_kernel = bench_script("moe_kernel")


def test_the_baseline_and_the_sorted_path_compute_the_reference(monkeypatch):
    monkeypatch.setitem(moe_kernel.SHAPES, "small", (32, 24, 16, 4))
    inputs = moe_kernel.make_inputs("small", 9)
    expected = reference_moe(*inputs)
    torch.testing.assert_close(moe_kernel.baseline_moe(*inputs), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(sorted_moe(*inputs), expected, atol=1e-5, rtol=0)


def test_a_short_run_prints_both_timings(capsys):
    argv = ["--shape", "qwen3", "--tokens", "2", "--iters", "1", "--warmup", "0", "--no-native"]
    assert moe_kernel.main(argv) == 0
    out = capsys.readouterr().out
    assert "qwen3 2 tokens: baseline" in out and "sorted" in out and "baseline/sorted x" in out
