"""KV cache budget on a GPU from a profiled forward pass (``--gpu-memory-utilization``), as vLLM sizes it.

The engine may use ``utilization × total`` bytes of the device. Of that, the weights, the activation peak
of the largest step it will run and the memory outside torch's allocator (CUDA context, cuBLAS/Triton
workspaces) are spoken for; the rest holds the KV cache:

    kv = utilization · total − weights − activation peak − non-torch

The activation peak is measured, not estimated: after the weights are loaded, one forward of a
``max_num_batched_tokens``-token prompt (the biggest chunk the scheduler builds) runs against a
throw-away KV cache just large enough for it, followed by the logits and a full-vocabulary sort of
``max_num_seqs`` rows (the sampler's widest temporaries). The KV budget is refused when it is not
positive, or when it exceeds what is free right now (other processes share the device).

Memory figures come from a ``DeviceMemory`` (torch.cuda on a GPU); tests pass a fake one, so the profile
run itself — the dummy batch, the forward, the arithmetic — runs on the CPU too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from kvpilot.engine.config import ConfigError
from kvpilot.engine.input_batch import InputBatch
from kvpilot.engine.kv.block_table import BlockTableTensor
from kvpilot.engine.kv.kv_cache import KVCache
from kvpilot.engine.model.llama import LlamaForCausalLM
from kvpilot.engine.model_runner import ModelRunner
from kvpilot.engine.sampling.params import SamplingParams
from kvpilot.engine.sequence import Sequence

log = logging.getLogger(__name__)
GIB = float(1 << 30)


class DeviceMemory(Protocol):
    """What the profile reads of a device's memory (the subset of ``torch.cuda`` it needs)."""

    def mem_get_info(self) -> tuple[int, int]: ...  # (free, total) bytes, all processes
    def memory_allocated(self) -> int: ...  # bytes in live tensors of this process
    def memory_reserved(self) -> int: ...  # bytes torch's caching allocator holds
    def max_memory_allocated(self) -> int: ...  # peak of memory_allocated since reset_peak
    def reset_peak(self) -> None: ...
    def synchronize(self) -> None: ...
    def empty_cache(self) -> None: ...


class CudaMemory:
    """``DeviceMemory`` of one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def memory_reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class MemoryBaseline:
    """The device before the engine loaded anything: what other processes (and nothing of ours) use."""

    free_bytes: int
    total_bytes: int
    torch_reserved_bytes: int


@dataclass(frozen=True)
class MemoryProfile:
    """What the profiled engine uses besides its KV cache, and what the device has free afterwards."""

    total_bytes: int
    free_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    #: growth of device memory outside torch's allocator since the baseline (context, workspaces)
    non_torch_bytes: int


def take_baseline(memory: DeviceMemory) -> MemoryBaseline:
    memory.synchronize()
    free, total = memory.mem_get_info()
    return MemoryBaseline(free, total, memory.memory_reserved())


def kv_budget_bytes(profile: MemoryProfile, utilization: float) -> int:
    """Bytes left for the KV cache within ``utilization`` of the device; ``ConfigError`` when none is."""
    requested = int(profile.total_bytes * utilization)
    used = profile.weights_bytes + profile.activation_peak_bytes + profile.non_torch_bytes
    budget = requested - used
    if budget <= 0:
        raise ConfigError(
            f"gpu_memory_utilization {utilization} allows {requested / GIB:.2f} GiB, but weights "
            f"({profile.weights_bytes / GIB:.2f} GiB), the activation peak "
            f"({profile.activation_peak_bytes / GIB:.2f} GiB) and non-torch memory "
            f"({profile.non_torch_bytes / GIB:.2f} GiB) already take "
            f"{used / GIB:.2f} GiB: no room for a KV cache; raise gpu_memory_utilization or lower "
            "max_num_batched_tokens"
        )
    if budget > profile.free_bytes:
        raise ConfigError(
            f"the KV cache would need {budget / GIB:.2f} GiB but only {profile.free_bytes / GIB:.2f} GiB of "
            f"the device are free (other processes use it); lower gpu_memory_utilization below "
            f"{utilization} or set kv_cache_memory_bytes"
        )
    return budget


def profile_step_memory(
    model: LlamaForCausalLM,
    memory: DeviceMemory,
    baseline: MemoryBaseline,
    *,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    num_tokens: int,
    num_seqs: int,
    kv_layout: str,
    kv_cache_dtype: str = "auto",
) -> MemoryProfile:
    """Run the largest step once and measure what it and the weights use (see the module docstring)."""
    arch = model.arch
    memory.synchronize()
    weights = memory.memory_allocated()
    num_blocks = -(-num_tokens // block_size) + 1  # block 0 stays reserved
    scratch = KVCache(
        arch.num_hidden_layers,
        num_blocks,
        block_size,
        arch.num_key_value_heads,
        arch.head_dim,
        dtype,
        device,
        layout=kv_layout,
        kv_cache_dtype=kv_cache_dtype,
    )
    probe = Sequence("memory-profile", [0] * num_tokens, SamplingParams(max_tokens=1))
    table = BlockTableTensor(1, num_blocks - 1, device)
    table.assign(probe.seq_id, list(range(1, num_blocks)))
    runner = ModelRunner(model, scratch, device, InputBatch(table, num_tokens, block_size, device))
    batch = runner.build_batch([(probe, num_tokens)])
    memory.synchronize()
    before = memory.memory_allocated()
    memory.reset_peak()
    with torch.inference_mode():
        hidden = model(batch.input_ids, batch.positions, scratch.layers, batch.meta)
        rows = hidden[-min(num_seqs, num_tokens) :]
        logits = model.compute_logits(rows)
        logits.log_softmax(dim=-1).sort(dim=-1, descending=True, stable=True)
    memory.synchronize()
    peak = memory.max_memory_allocated() - before
    del hidden, rows, logits, batch, runner, scratch
    memory.empty_cache()
    free, total = memory.mem_get_info()
    # device memory our process added beyond what torch's allocator holds
    non_torch = max(
        0, (baseline.free_bytes - free) - (memory.memory_reserved() - baseline.torch_reserved_bytes)
    )
    profile = MemoryProfile(
        total_bytes=total,
        free_bytes=free,
        weights_bytes=weights,
        activation_peak_bytes=max(0, peak),
        non_torch_bytes=non_torch,
    )
    log.info(
        "memory profile: weights %.2f GiB, activation peak %.2f GiB (%d tokens, %d logits rows), "
        "non-torch %.2f GiB, free %.2f of %.2f GiB",
        weights / GIB,
        profile.activation_peak_bytes / GIB,
        num_tokens,
        min(num_seqs, num_tokens),
        non_torch / GIB,
        free / GIB,
        total / GIB,
    )
    return profile


def profiled_kv_budget(
    model: LlamaForCausalLM,
    memory: DeviceMemory,
    baseline: MemoryBaseline,
    *,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    kv_layout: str,
    utilization: float,
    kv_cache_dtype: str = "auto",
) -> int:
    """The KV budget in bytes for ``utilization``, from one profiled step of the largest size the engine
    runs."""
    num_tokens = max(1, min(max_num_batched_tokens, max_model_len))
    profile = profile_step_memory(
        model,
        memory,
        baseline,
        device=device,
        dtype=dtype,
        block_size=block_size,
        num_tokens=num_tokens,
        num_seqs=max_num_seqs,
        kv_layout=kv_layout,
        kv_cache_dtype=kv_cache_dtype,
    )
    return kv_budget_bytes(profile, utilization)
