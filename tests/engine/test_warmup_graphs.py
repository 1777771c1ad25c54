"""The server's warm-up captures the decode graphs before ``/ready``, right after kernel tuning, and
reports the time as the ``graph_capture`` startup phase; its passes' decode steps then replay them. On
CPU the graphs are ``EagerReplay`` stand-ins on the Triton kernels (interpreter), as in
``test_decode_graphs.py``; with ``KVPILOT_TEST_DEVICE=cuda`` the engine captures real CUDA graphs."""

from triton_device import DEVICE  # isort: skip  (sets TRITON_INTERPRET=1 on CPU before the kernels load)

import pytest
from graph_replay import EagerReplay

from kvpilot.engine import LLM
from kvpilot.engine.decode_graphs import DecodeGraphs
from kvpilot.engine.model.fused_triton import TritonFusedOps
from kvpilot.engine.server.config import WarmupBucket
from kvpilot.engine.server.warmup import run_warmup

pytestmark = pytest.mark.triton

ENGINE = {
    "model": "tiny-random",
    "device": DEVICE.type,
    "dtype": "float32",
    "attention_backend": "triton",
    "block_size": 16,
    "max_num_seqs": 4,
    "num_kv_blocks": 32,
    "native_cpu_ops": "off",
    "cuda_graph_sizes": [1, 2, 4],
}


def _engine(enforce_eager: bool = False):
    engine = LLM(enforce_eager=enforce_eager, **ENGINE).engine
    if DEVICE.type == "cpu" and not enforce_eager:
        engine.model.fused_ops = TritonFusedOps()
        engine.runner.decode_graphs = DecodeGraphs(
            engine.model, engine.kv_cache, [1, 2, 4], engine.max_model_len, EagerReplay()
        )
    return engine


@pytest.mark.parametrize("buckets", [[WarmupBucket(2, 8)], []])
def test_warm_up_captures_the_graphs_before_its_passes(buckets):
    engine = _engine()
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.captured is None
    phases: list[str] = []
    captured_at_bucket: list[bool | None] = []

    run_warmup(
        engine,
        buckets,
        lambda i, bucket: captured_at_bucket.append(graphs.captured),
        lambda name, seconds: phases.append(name) if seconds >= 0 else None,
    )

    assert phases == (["kernel_tuning", "graph_capture"] if DEVICE.type == "cuda" else ["graph_capture"])
    assert graphs.captured is True
    assert captured_at_bucket == [True] * len(buckets)  # captured before the first pass ran
    # each pass makes two tokens: the second one's decode-only step replayed a graph
    assert graphs.replays == len(buckets)
    assert not engine.has_unfinished_requests()
    engine.check_invariants()


def test_an_eager_engine_has_no_capture_phase():
    engine = _engine(enforce_eager=True)
    phases: list[str] = []
    run_warmup(engine, [WarmupBucket(1, 4)], lambda i, bucket: None, lambda name, s: phases.append(name))
    assert engine.runner.decode_graphs is None
    assert "graph_capture" not in phases
