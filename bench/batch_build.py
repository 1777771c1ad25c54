"""What building a decode step's flat batch costs: the persistent batch against rebuilding it from lists.

    python bench/batch_build.py                          # 256 sequences x 2048 blocks, and 128 x 64
    python bench/batch_build.py --shape 256x2048 --steps 50

No model runs. ``--shape SEQSxBLOCKS`` sequences each hold a block table of BLOCKS blocks of 16 tokens (their
last block part full) in a ``KVCacheManager``, and every timed step schedules one decode token for each:
the KV manager allocates what it needs (a block every 16 steps per sequence, outside the timing), then the
batch is built and the token appended. ``rebuild`` is the engine's batch building before the persistent
batch, kept here as the baseline: every step it turns the manager's lists into a padded block-table
tensor (``torch.tensor`` of the padded lists) and the flat inputs; ``persistent`` is ``InputBatch.build``
over the ``BlockTableTensor`` the manager keeps. Prints the median per step of each (CPU tensors).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from kvpilot.engine.input_batch import InputBatch
from kvpilot.engine.kv.block_pool import BlockPool
from kvpilot.engine.kv.block_table import BlockTableTensor
from kvpilot.engine.kv.manager import KVCacheManager
from kvpilot.engine.sampling.params import SamplingParams
from kvpilot.engine.sequence import Sequence

BLOCK_SIZE = 16
CPU = torch.device("cpu")


def rebuild(scheduled: list[tuple[Sequence, int]], tables: list[list[int]], block_size: int) -> tuple:
    """The flat batch as the engine built it from lists every step (the baseline)."""
    ids: list[int] = []
    starts, seq_lens, query_lens = [0], [], []
    logits_rows: list[int] = []
    for req, n in scheduled:
        c = req.num_computed_tokens
        ids.extend(req.all_token_ids[c : c + n])
        starts.append(starts[-1] + n)
        seq_lens.append(c + n)
        query_lens.append(n)
        if c + n >= req.num_tokens:
            logits_rows.append(starts[-1] - 1)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = torch.tensor(starts, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    qlens = torch.tensor(query_lens)
    seq_of_token = torch.repeat_interleave(torch.arange(len(scheduled)), qlens)
    offset_in_seq = torch.arange(len(ids)) - qsl[:-1].long()[seq_of_token]
    positions = (lens.long() - qlens)[seq_of_token] + offset_in_seq
    blocks = block_tables[seq_of_token, positions // block_size].long()
    slot_mapping = blocks * block_size + positions % block_size
    return torch.tensor(ids), positions, slot_mapping, qsl, lens, block_tables, torch.tensor(logits_rows)


def setup(num_seqs: int, num_blocks: int, steps: int) -> tuple[KVCacheManager, InputBatch, list[Sequence]]:
    per_seq = num_blocks + steps // BLOCK_SIZE + 1
    tensor = BlockTableTensor(num_seqs, per_seq, CPU)
    pool = BlockPool(num_seqs * per_seq + 2, enable_caching=False)
    kv = KVCacheManager(pool, BLOCK_SIZE, b"r" * 16, block_tensor=tensor)
    max_len = per_seq * BLOCK_SIZE
    batch = InputBatch(tensor, max_len, BLOCK_SIZE, CPU)
    params = SamplingParams(temperature=0.0)
    reqs = []
    for i in range(num_seqs):
        # small token ids: Python caches them, so 256 x 32k prompt tokens cost list slots only
        req = Sequence(f"s{i}", [(i + j) % 200 for j in range(num_blocks * BLOCK_SIZE - 1)], params)
        kv.allocate(req, req.num_tokens)
        req.num_computed_tokens = req.num_tokens - 1
        reqs.append(req)
    return kv, batch, reqs


def measure(num_seqs: int, num_blocks: int, steps: int, warmup: int) -> dict[str, float]:
    kv, batch, reqs = setup(num_seqs, num_blocks, steps + warmup)
    scheduled = [(r, 1) for r in reqs]
    times: dict[str, list[float]] = {"rebuild": [], "persistent": []}
    for step in range(warmup + steps):
        for req in reqs:
            if not kv.allocate(req, 1):
                raise RuntimeError("the block pool is too small for the run")
        start = time.perf_counter()
        rebuild(scheduled, [kv.block_table(r) for r in reqs], BLOCK_SIZE)
        middle = time.perf_counter()
        batch.build(scheduled)
        end = time.perf_counter()
        if step >= warmup:  # the first build writes every slot's whole token row once
            times["rebuild"].append(middle - start)
            times["persistent"].append(end - middle)
        for req in reqs:
            req.num_computed_tokens += 1
            req.append_output_token(step % 200)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", action="append", help="SEQSxBLOCKS (repeatable; default 256x2048, 128x64)")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    shapes = args.shape or ["256x2048", "128x64"]
    for shape in shapes:
        seqs, blocks = (int(v) for v in shape.split("x"))
        ms = measure(seqs, blocks, args.steps, args.warmup)
        print(
            f"{seqs} seqs x {blocks} blocks: rebuild {ms['rebuild']:.3f} ms, persistent "
            f"{ms['persistent']:.3f} ms per step (x{ms['rebuild'] / ms['persistent']:.1f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
