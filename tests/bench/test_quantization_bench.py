"""``bench/quantization.py`` runs end to end on a tiny GGUF (Q8_0 and Q4_1 blocks): agreement of each
method with ``none``, perplexity, decode speed and its JSON report (a smoke test of the script, not a
measurement)."""

from __future__ import annotations

import json

import pytest
from bench_scripts import bench_script
from cpu_features import HAS_INT8_KERNEL
from gguf_files import write_llama_gguf
from quantized_ggufs import write_mixed_gguf

from kvpilot.engine.model.tiny import write_tiny_llama

#: the int8-activation methods run where the CPU has the kernel (AVX2 / AVX-512 VNNI)
A8 = ["gguf+a8", "int8+a8"] if HAS_INT8_KERNEL else []


def test_quantization_bench_reports_every_method(tmp_path, capsys):
    source = write_tiny_llama(tmp_path / "hf", seed=2)
    gguf = tmp_path / "tiny.gguf"
    parts = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    write_llama_gguf(gguf, source, types={f"blk.{i}.{p}.weight": "Q8_0" for i in range(2) for p in parts})
    out = tmp_path / "quant.json"
    argv = ["--model", str(gguf), "--tokens", "6", "--batches", "1", "3", "--steps", "2", "--rounds", "1"]
    argv += ["--methods", "none", "gguf", "int8", *A8]
    assert bench_script("quantization").main([*argv, "--kv-cache-mib", "8", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    methods = report["methods"]
    assert list(methods) == ["none", "gguf", "int8", *A8]
    assert methods["gguf"]["weights_mib"] < methods["none"]["weights_mib"]
    for method in ("gguf", "int8", *A8):
        entry = methods[method]
        prompts = entry["prompts"]
        assert entry["teacher_forced_positions"] == 6 * prompts
        assert 0 <= entry["teacher_forced_agree"] <= entry["teacher_forced_positions"]
        assert 0 <= entry["free_running_mean_first_divergence"] <= 6
        assert entry["perplexity"] > 1
    for entry in methods.values():
        assert set(entry["decode"]) == {"1", "3"}
        assert all(cell["tok_s"] > 0 for cell in entry["decode"].values())
    assert methods["none"]["decode"]["1"]["x_none"] == 1.0
    printed = capsys.readouterr().out
    assert "gguf: teacher-forced argmax agreement" in printed and "decode, best of 1 rounds" in printed


@pytest.mark.triton
@pytest.mark.slow  # the bench's real prompts (~1,000 tokens) through the Triton interpreter: ~40 s
def test_quantization_bench_runs_the_triton_gemm(tmp_path, capsys):
    """What ``bench/gpu_check.sh``'s ``quant`` step runs on CUDA, here in the Triton interpreter: ``none``
    against the GGUF's blocks on the Triton GEMM, the device and backend in the report."""
    gguf = write_mixed_gguf(tmp_path)
    out = tmp_path / "quant.json"
    argv = ["--model", str(gguf), "--methods", "none", "gguf", "--tokens", "2", "--batches", "2"]
    argv += ["--steps", "1", "--rounds", "1", "--kv-cache-mib", "8", "--output-json", str(out)]
    argv += ["--device", "cpu", "--dtype", "float32", "--linear-backend", "triton"]
    assert bench_script("quantization").main(argv) == 0
    report = json.loads(out.read_text())
    assert (report["device"], report["dtype"], report["linear_backend"]) == ("cpu", "float32", "triton")
    assert list(report["methods"]) == ["none", "gguf"]
    assert report["methods"]["gguf"]["weights_mib"] < report["methods"]["none"]["weights_mib"] / 2
    assert report["methods"]["gguf"]["decode"]["2"]["tok_s"] > 0
    assert "on cpu, float32, linear backend triton" in capsys.readouterr().out
