"""Captured decode (``engine/decode_graphs.py``): buckets, the static inputs a replay reads, and an engine
whose decode steps replay graphs generating what the eager engine generates.

On CPU the graphs are ``EagerReplay`` stand-ins (the capture's host lists frozen, the static tensors
live) over the Triton kernels in the interpreter; with ``KVPILOT_TEST_DEVICE=cuda`` the engine captures
real CUDA graphs and the same comparisons run on them.
"""

from triton_device import DEVICE  # isort: skip  (sets TRITON_INTERPRET=1 on CPU before the kernels load)

from types import SimpleNamespace

import pytest
import torch
from graph_replay import EagerReplay

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.engine.config import ConfigError
from kvpilot.engine.decode_graphs import CudaGraphCapture, DecodeGraphs, capture_sizes
from kvpilot.engine.engine_args import EngineArgs
from kvpilot.engine.input_batch import StepBatch
from kvpilot.engine.model.fused_triton import TritonFusedOps

pytestmark = pytest.mark.triton


def test_default_buckets_are_vllms_up_to_max_num_seqs():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
    assert capture_sizes(1000)[-3:] == [496, 504, 512]
    assert capture_sizes(64, (8, 2, 8, 5)) == [2, 5, 8]
    with pytest.raises(ValueError, match=r"1\.\.max_num_seqs=4"):
        capture_sizes(4, (2, 8))


@pytest.mark.parametrize("sizes", [(0, 4), (4, 65), (True,), ("8",)])
def test_cuda_graph_sizes_outside_the_batch_are_a_config_error(sizes):
    with pytest.raises(ConfigError, match=r"cuda_graph_sizes must be batch sizes in 1\.\.max_num_seqs=64"):
        EngineArgs(cuda_graph_sizes=sizes).create_config()
    assert EngineArgs(cuda_graph_sizes=[4, 8]).create_config().cuda_graph_sizes == (4, 8)


class _RecordingModel:
    """A model stand-in: returns each row's position as its hidden state and records the static inputs
    every run saw."""

    backend = SimpleNamespace(supports_captured_decode=True)

    def __init__(self) -> None:
        self.seen: list[dict[str, list]] = []

    def __call__(self, input_ids, positions, layers, meta):
        assert meta.captured and meta.num_decodes == meta.num_seqs == input_ids.shape[0]
        self.seen.append(
            {
                "ids": input_ids.tolist(),
                "slots": meta.slot_mapping.tolist(),
                "lens": meta.seq_lens.tolist(),
                "tables": meta.block_tables[:, :3].tolist(),
            }
        )
        return positions.float()[:, None].repeat(1, 2)


def _decode_batch(rows: list[tuple[int, int, list[int]]]) -> StepBatch:
    """A decode-only batch: (token id, context length, block ids) per sequence, block size 4."""
    lens = [length for _, length, _ in rows]
    width = max(len(blocks) for _, _, blocks in rows)
    tables = torch.tensor([blocks + [0] * (width - len(blocks)) for _, _, blocks in rows], dtype=torch.int32)
    positions = torch.tensor([n - 1 for n in lens])
    slots = torch.tensor([blocks[(n - 1) // 4] * 4 + (n - 1) % 4 for _, n, blocks in rows])
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        num_decodes=len(rows),
        query_lens_host=[1] * len(rows),
        seq_lens_host=lens,
        block_size=4,
    )
    ids = torch.tensor([token for token, _, _ in rows])
    return StepBatch(ids, positions, meta, torch.arange(len(rows)), [], [], [1] * len(rows))


def test_a_replay_reads_the_steps_rows_and_padding_never_a_previous_steps():
    model = _RecordingModel()
    layer = SimpleNamespace(key=torch.empty(0))
    graphs = DecodeGraphs(model, SimpleNamespace(block_size=4, layers=[layer]), [2, 4], 16, EagerReplay())
    three = _decode_batch([(5, 3, [7]), (6, 9, [2, 3, 9]), (8, 5, [4, 1])])
    hidden = graphs.run(three)
    assert graphs.captured and graphs.replays == 1
    # captured largest first (an eager run each), then the 3-row step replayed in the 4-row bucket
    assert [len(s["ids"]) for s in model.seen] == [4, 2, 4]
    assert model.seen[-1] == {
        "ids": [5, 6, 8, 0],
        "slots": [30, 36, 4, 0],
        "lens": [3, 9, 5, 1],
        "tables": [[7, 0, 0], [2, 3, 9], [4, 1, 0], [0, 0, 0]],
    }
    assert hidden.tolist() == [[2.0, 2.0], [8.0, 8.0], [4.0, 4.0]]
    one = _decode_batch([(9, 2, [5])])
    assert graphs.run(one).tolist() == [[1.0, 1.0]]
    # rows 1-2 held the 3-row step's sequences: reset to the padding state, not replayed at their slots
    assert model.seen[-1] == {
        "ids": [9, 0],
        "slots": [21, 0],
        "lens": [2, 1],
        "tables": [[5, 0, 0], [0, 0, 0]],
    }
    # not decode-only, or larger than every bucket: eager (None), nothing replayed
    assert graphs.run(_decode_batch([(1, 2, [1])] * 5)) is None
    mixed = _decode_batch([(1, 2, [1])] * 2)
    mixed.meta.num_decodes = 1  # as if the second sequence were a prefill
    assert graphs.run(mixed) is None
    assert graphs.replays == 2 and len(model.seen) == 4


ENGINE = {
    "model": "tiny-random",
    "device": DEVICE.type,
    "dtype": "float32",
    "block_size": 16,
    "max_num_seqs": 6,
    "max_num_batched_tokens": 64,
    "num_kv_blocks": 64,
    "native_cpu_ops": "off",
    "cuda_graph_sizes": [1, 2, 4, 6],
}
# eight requests for six slots, each its own length: the decode batch grows, pads to a bucket and shrinks
PROMPTS = [[(11 * i + 7 * j) % 240 + 5 for j in range(4 + 9 * i)] for i in range(8)]
MAX_TOKENS = [9, 4, 12, 6, 3, 10, 5, 7]


def _generate(backend: str, graphs: bool):
    llm = LLM(attention_backend=backend, enforce_eager=not graphs, **ENGINE)
    engine = llm.engine
    if DEVICE.type == "cpu":
        if backend == "triton":  # the layer path CUDA takes
            engine.model.fused_ops = TritonFusedOps()
        if graphs:
            engine.runner.decode_graphs = DecodeGraphs(
                engine.model, engine.kv_cache, [1, 2, 4, 6], engine.max_model_len, EagerReplay()
            )
    decode_steps: list[int] = []  # the size of each decode-only step
    execute = engine.runner.execute

    def counting_execute(batch):
        meta = batch.meta
        if meta.num_decodes == meta.num_seqs == meta.num_tokens:
            decode_steps.append(meta.num_seqs)
        return execute(batch)

    engine.runner.execute = counting_execute
    params = [SamplingParams(max_tokens=m, temperature=0.0, logprobs=2) for m in MAX_TOKENS]
    outputs = llm.generate(PROMPTS, params)
    engine.check_invariants()
    return outputs, engine.runner.decode_graphs, decode_steps


def _logprobs(outputs) -> list[list[float]]:
    return [
        [entry[t].logprob for entry, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)]
        for o in outputs
    ]


def test_replayed_decode_generates_the_eager_engines_tokens():
    eager, none, eager_steps = _generate("triton", graphs=False)
    replayed, graphs, decode_steps = _generate("triton", graphs=True)
    assert none is None
    assert graphs is not None and graphs.captured
    if DEVICE.type == "cuda":
        assert isinstance(graphs.capture_backend, CudaGraphCapture)
    # the same schedule, and every decode-only step replayed, padded ones (3, 5) among them
    assert decode_steps == eager_steps and graphs.replays == len(decode_steps)
    assert {3, 5} <= set(decode_steps) and 6 in decode_steps
    assert [o.outputs[0].token_ids for o in replayed] == [o.outputs[0].token_ids for o in eager]
    for got, want in zip(_logprobs(replayed), _logprobs(eager), strict=True):
        assert got == pytest.approx(want, abs=1e-5)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the stand-in's negative control; CUDA refuses the capture")
def test_a_backend_planning_from_the_host_lists_fails_under_the_stand_in():
    """Negative control: the torch backend sizes its gathers from ``seq_lens_host``, which a replay
    keeps at the capture's placeholder lengths, so replaying it does not give the eager tokens. (Its
    ``supports_captured_decode`` is False: the engine never captures it.)"""
    eager, _, _ = _generate("torch", graphs=False)
    try:
        replayed, _, _ = _generate("torch", graphs=True)
    except (RuntimeError, ValueError, IndexError):
        return  # failing loudly is also a failure to replay
    assert [o.outputs[0].token_ids for o in replayed] != [o.outputs[0].token_ids for o in eager]
