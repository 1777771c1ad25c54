"""``bench/batch_build.py``: its baseline (the engine's batch building from lists before the persistent batch)
and ``InputBatch.build`` give the same batch step after step, and a short run prints both timings."""

from __future__ import annotations

from bench_scripts import bench_script

batch_build = bench_script("batch_build")


def test_the_baseline_and_the_persistent_batch_build_the_same_batch():
    kv, batch, reqs = batch_build.setup(5, 3, 40)
    scheduled = [(r, 1) for r in reqs]
    for step in range(40):  # crosses block boundaries: new blocks are appended to the tensor
        for req in reqs:
            assert kv.allocate(req, 1)
        ids, positions, slots, qsl, lens, tables, rows = batch_build.rebuild(
            scheduled, [kv.block_table(r) for r in reqs], batch_build.BLOCK_SIZE
        )
        built = batch.build(scheduled)
        assert built.input_ids.tolist() == ids.tolist()
        assert built.positions.tolist() == positions.tolist()
        assert built.meta.slot_mapping.tolist() == slots.tolist()
        assert built.meta.query_start_loc.tolist() == qsl.tolist()
        assert built.meta.seq_lens.tolist() == lens.tolist()
        assert built.meta.block_tables.tolist() == tables.tolist()
        assert built.logits_indices.tolist() == rows.tolist()
        for req in reqs:
            req.num_computed_tokens += 1
            req.append_output_token(step)
    kv.check_invariants()


def test_a_short_run_prints_both_timings(capsys):
    assert batch_build.main(["--shape", "4x8", "--steps", "3", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "4 seqs x 8 blocks: rebuild" in out and "persistent" in out
