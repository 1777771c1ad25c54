"""``bench/kv_cache_dtype.py`` runs end to end on the tiny model: blocks per dtype in one budget, agreement
and perplexity of fp8/int8 against auto, the float cache's value ranges, decode speed and its JSON report
(a smoke test of the script, not a measurement)."""

from __future__ import annotations

import json

from bench_scripts import bench_script


def test_kv_cache_dtype_bench_reports_every_dtype(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "kv.json"
    argv = ["--model", "tiny-random", "--tokens", "4", "--batches", "2", "--steps", "2", "--rounds", "1"]
    assert bench_script("kv_cache_dtype").main([*argv, "--kv-cache-mib", "4", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    dtypes = report["dtypes"]
    assert list(dtypes) == ["auto", "fp8", "int8"]
    # 4 MiB of 16-token blocks: 512, 160 and 160 bytes per token (tiny-random: 2 layers x 2 KV heads x 16)
    assert [d["kv_blocks"] for d in dtypes.values()] == [512, 1638, 1638]
    for kv in ("fp8", "int8"):
        entry = dtypes[kv]
        assert entry["teacher_forced_positions"] == 4 * entry["prompts"]
        assert 0 <= entry["free_running_mean_first_divergence"] <= 4
        assert entry["perplexity"] > 1
    assert report["auto_kv_ranges"]["blocks"] > 0 and report["auto_kv_ranges"]["worst_k_absmax"] > 0
    assert all(entry["decode"]["2"]["tok_s"] > 0 for entry in dtypes.values())
    assert "int8: perplexity" in capsys.readouterr().out
