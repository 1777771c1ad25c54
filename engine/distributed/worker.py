"""A tensor-parallel worker: ranks 1..tp-1, each a process the engine starts
(docs/architecture.md#tensor-parallelism).

A worker joins the groups, loads its shard of the model, allocates a KV cache of the block count rank 0
sends (its own heads, the same blocks), then repeats: receive a step, replay its KV operations, run the
forward (its collectives meet rank 0's) and the LM head shard when the step has logits rows. It holds no
scheduler, sampler or tokenizer: rank 0 decides everything, the worker only computes.

A worker never outlives the engine: the kernel ends it when its parent dies (``PR_SET_PDEATHSIG``), and a
broken group (rank 0 gone) ends its loop with an error. ``STOP`` ends it cleanly.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from kvpilot.engine.config import EngineConfig
from kvpilot.engine.distributed.groups import TensorParallelGroup
from kvpilot.engine.distributed.kv_replica import replay
from kvpilot.engine.distributed.sharding import TensorParallelRank, TensorShard
from kvpilot.engine.distributed.step_message import (
    ALLOCATE,
    INLINE_LEN,
    MESSAGE_LEN,
    STEP,
    STOP,
    decode_step,
    payload_length,
)
from kvpilot.engine.kv.kv_cache import HostSwapSpace, KVCache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process is started with (pickled into it)."""

    config: EngineConfig
    size: int
    port: int
    #: rank 0's device; a CUDA worker takes the device ``rank`` places after it
    device: str
    collective_timeout_s: float
    store_timeout_s: float


def worker_device(spec: WorkerSpec, rank: int) -> torch.device:
    base = torch.device(spec.device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux); elsewhere the broken group
    ends it."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def worker_main(rank: int, spec: WorkerSpec) -> None:
    """The process's entry point (``torch.multiprocessing`` spawn)."""
    _die_with_parent()
    logging.basicConfig(level=logging.WARNING, format=f"[tp rank {rank}] %(levelname)s %(message)s")
    device = worker_device(spec, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = TensorParallelGroup(
        rank, spec.size, spec.port, device, spec.collective_timeout_s, spec.store_timeout_s
    )
    group.connect()
    try:
        _serve(rank, spec, device, group)
    finally:
        group.close()


def _serve(rank: int, spec: WorkerSpec, device: torch.device, group: TensorParallelGroup) -> None:
    # imported here: the process pays the import once it has joined the groups (rank 0 waits on that)
    from kvpilot.engine.engine_setup import load_served_model
    from kvpilot.engine.model.arch import ModelArchConfig
    from kvpilot.engine.model.loader import resolve_dtype, resolve_linear_backend, resolve_native_ops
    from kvpilot.engine.model.registry import default_cache_dir, resolve_model

    config, mc = spec.config, spec.config.model
    dtype = resolve_dtype(mc.dtype, device)
    cache_dir = Path(mc.download_dir) if mc.download_dir else default_cache_dir()
    native = resolve_native_ops(config.native_cpu_ops, device, dtype, cache_dir)
    arch = ModelArchConfig.from_dir(resolve_model(mc.model, cache_dir=mc.download_dir))
    served = load_served_model(
        mc.model,
        config,
        device,
        dtype,
        resolve_linear_backend(config.linear_backend, device, dtype),
        native,
        mc.quantization,
        TensorParallelRank(TensorShard(arch, rank, spec.size), group),
    )
    message = torch.zeros(MESSAGE_LEN, dtype=torch.int64)
    group.broadcast_control(message)
    if int(message[0]) == STOP:
        return  # rank 0 gave up during start-up
    assert int(message[0]) == ALLOCATE, f"expected the KV cache's sizes, got command {int(message[0])}"
    num_blocks, swap_blocks = int(message[2]), int(message[3])
    local = served.model.arch
    kv_cache = KVCache(
        local.num_hidden_layers,
        num_blocks,
        config.cache.block_size,
        local.num_key_value_heads,
        local.head_dim,
        dtype,
        device,
        layout=served.backend.kv_cache_layout,
        kv_cache_dtype=config.cache.kv_cache_dtype,
        fp8_scales=served.fp8_kv_scales(),
    )
    swap = HostSwapSpace(kv_cache, swap_blocks) if swap_blocks else None
    model, block_size = served.model, config.cache.block_size
    while True:
        group.broadcast_control(message)
        command = int(message[0])
        if command == STOP:
            return
        assert command == STEP, f"unknown command {command}"
        rest = None
        if payload_length(message) > INLINE_LEN:
            rest = torch.empty(payload_length(message) - INLINE_LEN, dtype=torch.int64)
            group.broadcast_control(rest)
        step = decode_step(message, rest)
        replay(step.kv_ops, kv_cache, swap)
        inputs = step.to(device) if device.type != "cpu" else step
        hidden = model(inputs.input_ids, inputs.positions, kv_cache.layers, inputs.metadata(block_size))
        if inputs.logits_indices.numel():
            model.compute_logits(hidden.index_select(0, inputs.logits_indices))  # rank 0 gathers them
