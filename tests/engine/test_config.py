"""Engine arguments: one flat vLLM-named bag that is exactly the union of the per-area configs."""

from __future__ import annotations

from dataclasses import MISSING, fields

import pytest

from kvpilot.engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from kvpilot.engine.engine_args import EngineArgs


def test_engine_args_are_the_union_of_the_area_configs_with_equal_defaults():
    areas = [ModelConfig, CacheConfig, SchedulerConfig]
    top = [f for f in fields(EngineConfig) if f.name not in ("model", "cache", "scheduler")]
    flat = {f.name: f.default for f in fields(EngineArgs)}
    area_fields = [f for a in areas for f in fields(a)] + top
    assert sorted(flat) == sorted(f.name for f in area_fields)
    for f in area_fields:
        if f.default is not MISSING:
            assert flat[f.name] == f.default, f.name
    config = EngineArgs(block_size=32, max_num_seqs=7, logprobs_mode="processed_logprobs").create_config()
    assert (config.cache.block_size, config.scheduler.max_num_seqs, config.logprobs_mode) == (
        32,
        7,
        "processed_logprobs",
    )


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"block_size": 3}, "block_size"),
        ({"num_kv_blocks": 1}, "num_kv_blocks"),
        ({"preemption_mode": "swap"}, "swap_space"),
        ({"max_num_seqs": 100, "max_num_batched_tokens": 50}, "max_num_batched_tokens"),
        ({"attention_backend": "cuda"}, "attention_backend"),
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
        ({"dtype": "int8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"logprobs_mode": "raw"}, "logprobs_mode"),
    ],
)
def test_invalid_engine_args_name_the_argument(kwargs, text):
    with pytest.raises(ConfigError, match=text):
        EngineArgs(**kwargs).create_config()


def test_unknown_argument_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown engine argument.*'gpu_blocks'.*valid: .*block_size"):
        EngineArgs.from_kwargs(gpu_blocks=3)
