"""``bench/spec_decode.py`` runs end to end on the tiny model: it checks greedy agreement, reports batch-1
and sweep ratios, and writes its JSON (a smoke test of the script, not a measurement)."""

from __future__ import annotations

import json

from bench_scripts import bench_script


def test_spec_decode_bench_reports_agreement_and_ratios(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "spec.json"
    argv = ["--model", str(tiny_model_dir), "--k", "2", "--rounds", "1", "--batches", "1", "2"]
    assert bench_script("spec_decode").main([*argv, "--max-tokens", "12", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["batch1"]) == {"plain", "ngram k=2"}
    assert report["batch1"]["plain"]["ratio"] == 1.0
    assert set(report["sweep"]) == {"1", "2"}
    assert "greedy tokens identical" in capsys.readouterr().out
