"""``bench/tp_step.py``: the per-step collectives arithmetic the GPU table uses, and (slow) a short run
whose counted collectives on rank 0 equal it."""

from __future__ import annotations

import json

import pytest
from bench_scripts import bench_script

tp_step = bench_script("tp_step")


def test_a_decode_step_has_two_all_reduces_per_layer_plus_the_embeddings():
    # Llama-3-70B, bf16, tp=8, one decode token: 161 all-reduces of 8192 × 2 bytes, 16032 logits per rank
    c = tp_step.step_collectives(80, 8192, 128256, 8, tokens=1, rows=1, act_bytes=2)
    assert (c.all_reduces, c.all_reduce_bytes, c.gather_bytes_per_rank) == (161, 16384, 16032 * 4)
    assert tp_step.ring_bytes_per_rank(16384, 8) == 28672.0  # 2 · 7/8 of the buffer


def test_padded_vocab_shards_round_up():
    assert tp_step.step_collectives(1, 64, 301, 2, 3, 2, 4).gather_bytes_per_rank == 2 * 151 * 4


@pytest.mark.slow
def test_short_run_counts_the_collectives_it_predicts(tmp_path):
    out = tmp_path / "tp.json"
    args = ["--layers", "2", "--batch", "2", "--prompt-len", "4", "--steps", "3", "--warmup", "1"]
    assert tp_step.main([*args, "--output-json", str(out)]) == 0  # main asserts the counts
    report = json.loads(out.read_text())
    assert [r["tp"] for r in report["results"]] == [1, 2]
    assert report["results"][1]["all_reduces"] == 5 * 3
    assert report["results"][0]["all_reduces"] == 0


def test_bad_sizes_are_refused(capsys):
    with pytest.raises(SystemExit):
        tp_step.main(["--tp", "1"])
    assert "--tp must be >= 2" in capsys.readouterr().err
