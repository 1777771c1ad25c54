"""Host-side decisions of the Triton backend: the split-KV heuristic and the launch-configuration tuner."""

import os

# split_kv defines a kernel: it must not be imported for compilation on a CPU-only machine.
os.environ["TRITON_INTERPRET"] = "1"

import pytest
from triton.runtime.errors import OutOfResources

from kvpilot.engine.attention.kernels import split_kv
from kvpilot.engine.attention.kernels.tuning import (
    DECODE_DEFAULT,
    ConfigTable,
    KernelConfig,
    decode_candidates,
    prefill_candidates,
)

pytestmark = pytest.mark.triton


@pytest.mark.parametrize(
    "active_lens, kv_heads, num_sms, expected",
    [
        ([8192], 8, 132, (16, 256)),  # one long sequence: as many splits as allowed
        ([8192] * 8, 8, 132, (5, 1986)),  # 64 programs: splits of ~2k keys give the 264 wanted
        ([8192] * 64, 8, 132, (1, 15888)),  # the batch alone fills the GPU
        ([600], 8, 132, (3, 256)),  # short context: >= 256 keys per split
        ([100], 1, 132, (1, 256)),
        ([4096, 4096], 2, 1, (1, 8192)),  # the interpreter (1 "SM") never needs more programs
        # 127 chat turns and one 32k context: only the long one is split, into pieces of the
        # batch's average work per program, instead of it running alone in one program per KV head
        ([1024] * 127 + [32768], 8, 132, (7, 4934)),
        ([1024] * 128, 8, 132, (1, 3972)),  # the same batch without it: nothing to split
    ],
)
def test_split_plan(active_lens, kv_heads, num_sms, expected):
    plan = split_kv.plan_kv_splits(active_lens, kv_heads, num_sms)
    assert (plan.num_kv_splits, plan.min_split_tokens) == expected


@pytest.mark.parametrize(
    "num_seqs, kv_heads, num_sms, splits",
    [
        (1, 8, 132, 16),  # one sequence: as many splits as allowed, for when its context is long
        (4, 8, 132, 9),  # 32 (sequence, head) pairs: 9 splits each reach the 264 programs wanted
        (16, 8, 132, 3),
        (128, 8, 132, 1),  # the batch alone fills the GPU
        (8, 2, 1, 1),  # the interpreter's one "SM"
    ],
)
def test_a_captured_decode_plans_for_long_contexts_with_a_floor_per_split(
    num_seqs, kv_heads, num_sms, splits
):
    plan = split_kv.plan_for_capture(num_seqs, kv_heads, num_sms)
    assert (plan.num_kv_splits, plan.min_split_tokens) == (splits, 256)
    with pytest.raises(ValueError, match="positive num_seqs"):
        split_kv.plan_for_capture(0, kv_heads, num_sms)


def test_split_plan_rejects_empty_launches():
    with pytest.raises(ValueError, match="at least one key"):
        split_kv.plan_kv_splits([], 8, 132)
    with pytest.raises(ValueError, match="at least one key"):
        split_kv.plan_kv_splits([5, 0], 8, 132)


def test_attended_keys_stop_at_the_window():
    assert split_kv.attended_keys([5, 300, 40], None) == [5, 300, 40]
    assert split_kv.attended_keys([5, 300, 40], 32) == [5, 32, 32]


def test_tuner_keeps_the_fastest_fitting_config():
    timings = {32: 3.0, 64: 1.0, 128: 2.0}
    table = ConfigTable()
    key = (128, 4, 16, "float16", False)
    assert table.get("decode", key, DECODE_DEFAULT) == DECODE_DEFAULT and not table.is_tuned("decode", key)
    ran = []

    def measure(launch):
        launch()
        config = ran[-1]
        if config.num_warps == 4:
            raise OutOfResources(99999, 65536, "shared memory")
        return timings[config.tile_n] + config.num_stages / 10

    best = table.tune("decode", key, decode_candidates(128), ran.append, measure)
    assert best == KernelConfig(tile_n=64, num_warps=2, num_stages=1)
    assert table.get("decode", key, DECODE_DEFAULT) == best
    assert table.get("decode", (64, 1, 16, "float16", False), DECODE_DEFAULT) == DECODE_DEFAULT
    assert len(ran) == len(decode_candidates(128))


def test_tuner_fails_loudly_when_nothing_fits():
    def measure(launch):
        raise OutOfResources(1, 0, "shared memory")

    with pytest.raises(RuntimeError, match="no launch configuration"):
        ConfigTable().tune("prefill", ("k",), prefill_candidates(64), lambda config: None, measure)


def test_wide_heads_get_smaller_tiles():
    assert max(c.block_m for c in prefill_candidates(256)) < max(c.block_m for c in prefill_candidates(128))
    assert max(c.tile_n for c in decode_candidates(256)) < max(c.tile_n for c in decode_candidates(64))


@pytest.mark.parametrize(
    "kwargs", [{"tile_n": 8}, {"tile_n": 48}, {"num_warps": 3}, {"num_stages": 0}, {"block_m": 8}]
)
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        KernelConfig(**{"tile_n": 32, "num_warps": 4, "num_stages": 2, **kwargs})
