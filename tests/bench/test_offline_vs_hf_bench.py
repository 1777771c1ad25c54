"""``bench/offline_vs_hf.py`` end to end on a tiny workload: three kvpilot runs interleaved with HF's, the
median counted, every figure in the JSON (real model and HF transformers: slow)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "offline_vs_hf.py"


@pytest.mark.slow
def test_tiny_offline_vs_hf_run_reports_the_median_of_interleaved_runs(tmp_path):
    out = tmp_path / "result.json"
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--num-requests",
            "3",
            "--prompt-len",
            "8:16",
            "--output-len",
            "2:4",
            "--kvpilot-runs",
            "3",
            "--output-json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    order = [i for i, line in enumerate(lines) if line.startswith(("kvpilot (continuous", "HF "))]
    kinds = [lines[i].split(":")[0].split(",")[0] for i in order]
    assert kinds == [
        "kvpilot (continuous batching)",
        "HF padded batch",
        "kvpilot (continuous batching)",
        "HF one at a time (3 requests)",
        "kvpilot (continuous batching)",
    ], result.stdout
    report = json.loads(out.read_text())
    runs = report["kvpilot"]["runs_wall_s"]
    assert len(runs) == 3 and report["kvpilot"]["wall_s"] == sorted(runs)[1]
    assert report["kvpilot"]["cached_prompt_tokens"] == 0
    assert report["ratios"]["vs_hf_one_at_a_time"] == pytest.approx(
        report["kvpilot"]["output_tok_per_s"] / report["hf_one_at_a_time"]["output_tok_per_s"]
    )
    assert report["prefix_caching"]["hit_cached_tokens"] == 1024


def test_kvpilot_runs_outside_1_to_9_is_a_usage_error():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--kvpilot-runs", "0"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and "--kvpilot-runs" in result.stderr
