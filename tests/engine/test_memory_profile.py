"""The KV budget from ``gpu_memory_utilization``: the arithmetic, its refusals, and the engine's profiled
sizing end to end on the CPU with scripted memory figures (the profiled forward itself really runs)."""

from __future__ import annotations

import pytest

from kvpilot.engine.config import ConfigError
from kvpilot.engine.engine_args import EngineArgs
from kvpilot.engine.engine_core import LLMEngine
from kvpilot.engine.memory_profile import MemoryProfile, kv_budget_bytes
from kvpilot.engine.stats import load_snapshot

GIB = 1 << 30


def test_budget_is_the_utilized_share_minus_weights_activations_and_non_torch_memory() -> None:
    profile = MemoryProfile(
        total_bytes=100 * GIB,
        free_bytes=80 * GIB,
        weights_bytes=16 * GIB,
        activation_peak_bytes=2 * GIB,
        non_torch_bytes=1 * GIB,
    )
    assert kv_budget_bytes(profile, 0.9) == 90 * GIB - 19 * GIB
    assert kv_budget_bytes(profile, 0.5) == 50 * GIB - 19 * GIB


def test_budget_refuses_no_room_and_more_than_is_free() -> None:
    tight = MemoryProfile(
        total_bytes=20 * GIB,
        free_bytes=4 * GIB,
        weights_bytes=16 * GIB,
        activation_peak_bytes=2 * GIB,
        non_torch_bytes=1 * GIB,
    )
    with pytest.raises(ConfigError, match=r"no room for a KV cache; raise gpu_memory_utilization"):
        kv_budget_bytes(tight, 0.9)
    shared = MemoryProfile(
        total_bytes=100 * GIB,
        free_bytes=10 * GIB,
        weights_bytes=16 * GIB,
        activation_peak_bytes=2 * GIB,
        non_torch_bytes=0,
    )
    with pytest.raises(
        ConfigError, match=r"only 10.00 GiB of the device are free .*lower gpu_memory_utilization"
    ):
        kv_budget_bytes(shared, 0.9)


class ScriptedMemory:
    """A device whose figures are fixed: weights ``W`` allocated, a step peaks ``A`` above them,
    ``NON_TORCH`` bytes appear outside torch's allocator once the engine has loaded."""

    TOTAL, FREE, W, A, NON_TORCH = 64 << 20, 60 << 20, 5 << 20, 3 << 20, 1 << 20

    def __init__(self) -> None:
        self.loaded = False
        self.peak_resets = 0

    def mem_get_info(self) -> tuple[int, int]:
        used = self.W + self.NON_TORCH if self.loaded else 0
        return self.FREE - used, self.TOTAL

    def memory_allocated(self) -> int:
        self.loaded = True  # first read after the weights were loaded
        return self.W

    def memory_reserved(self) -> int:
        return self.W if self.loaded else 0

    def max_memory_allocated(self) -> int:
        return self.W + self.A

    def reset_peak(self) -> None:
        self.peak_resets += 1

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass


def test_engine_sizes_its_kv_cache_from_the_profiled_budget(tiny_model_dir) -> None:
    memory = ScriptedMemory()
    config = EngineArgs(
        model="tiny-random",
        device="cpu",
        block_size=16,
        max_num_batched_tokens=256,
        gpu_memory_utilization=0.5,
    ).create_config()
    engine = LLMEngine(config, device_memory=memory)
    budget = int(ScriptedMemory.TOTAL * 0.5) - ScriptedMemory.W - ScriptedMemory.A - ScriptedMemory.NON_TORCH
    per_block = engine.kv_bytes_per_token * 16
    assert memory.peak_resets == 1  # one profiled step
    assert engine.kv_cache.num_blocks == budget // per_block
    snap = load_snapshot(engine)
    assert (snap["kv_cache_sizing"], snap["kv_blocks_total"]) == (
        "gpu_memory_utilization",
        budget // per_block - 1,
    )
    assert snap["kv_cache_bytes"] == (budget // per_block) * per_block
    # the engine still serves after the profile (its scratch cache is gone, the real one is in place)
    engine.add_request("r", [5, 6, 7], None)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.pool.num_in_use == 0


def test_fixed_sizes_skip_the_profile(tiny_model_dir) -> None:
    memory = ScriptedMemory()
    fixed = EngineArgs(model="tiny-random", device="cpu", kv_cache_memory_bytes=1 << 20).create_config()
    engine = LLMEngine(fixed, device_memory=memory)
    assert memory.peak_resets == 0 and engine.kv_cache_sizing == "kv_cache_memory_bytes"
    assert engine.kv_cache.num_blocks == (1 << 20) // (engine.kv_bytes_per_token * 16)
    assert (
        LLMEngine(EngineArgs(model="tiny-random", device="cpu").create_config()).kv_cache_sizing
        == "cpu_default"
    )
