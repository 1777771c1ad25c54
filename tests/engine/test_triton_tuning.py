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
    "num_seqs, kv_heads, active_len, num_sms, expected",
    [
        (1, 8, 8192, 132, 16),  # one long sequence: as many splits as allowed
        (8, 8, 8192, 132, 5),  # 64 programs, 264 wanted -> 5 splits
        (64, 8, 8192, 132, 1),  # the batch alone fills the GPU
        (1, 8, 600, 132, 3),  # short context: >= 256 tokens per split
        (1, 1, 100, 132, 1),
        (2, 2, 4096, 1, 1),  # the interpreter (1 "SM") never needs more programs
    ],
)
def test_split_heuristic(num_seqs, kv_heads, active_len, num_sms, expected):
    assert split_kv.choose_num_kv_splits(num_seqs, kv_heads, active_len, num_sms) == expected


def test_split_heuristic_rejects_empty_launches():
    with pytest.raises(ValueError, match="positive"):
        split_kv.choose_num_kv_splits(0, 8, 100, 132)


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
