"""How an engine is put together at start-up: a served model (weights, attention backend, quantization),
the paged KV cache sized for it (docs/architecture.md#kv-lifecycle) and the runner that steps the model
over it. The target model and a speculative draft model load the same way."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kvpilot.engine.attention.backend import AttentionBackend, select_backend
from kvpilot.engine.attention.torch_backend import TorchAttentionBackend
from kvpilot.engine.capacity_plan import kv_cache_sizing, plan_max_model_len, plan_num_kv_blocks
from kvpilot.engine.config import EngineConfig
from kvpilot.engine.decode_graphs import decode_graphs_for
from kvpilot.engine.distributed.executor import TensorParallelRunner, TensorParallelWorkers
from kvpilot.engine.distributed.kv_replica import RecordingKVCache, RecordingSwapSpace
from kvpilot.engine.distributed.sharding import TensorParallelRank, check_tensor_parallel
from kvpilot.engine.distributed.step_message import KVOp
from kvpilot.engine.input_batch import InputBatch
from kvpilot.engine.kv.block_hash import root_hash
from kvpilot.engine.kv.block_pool import BlockPool
from kvpilot.engine.kv.block_table import BlockTableTensor
from kvpilot.engine.kv.capacity import blocks_for_tokens, kv_bytes_per_token
from kvpilot.engine.kv.checkpoint_scales import read_kv_scales
from kvpilot.engine.kv.events import KVEventLog
from kvpilot.engine.kv.kv_cache import HostSwapSpace, KVCache
from kvpilot.engine.kv.kv_quant import scale_bytes_per_element_row, storage_dtype
from kvpilot.engine.kv.manager import KVCacheManager
from kvpilot.engine.memory_profile import (
    CudaMemory,
    DeviceMemory,
    MemoryBaseline,
    profiled_kv_budget,
    take_baseline,
)
from kvpilot.engine.model.arch import ModelArchConfig
from kvpilot.engine.model.llama import LlamaForCausalLM
from kvpilot.engine.model.loader import load_model
from kvpilot.engine.model.quantization import resolve_activation_quantization, resolve_quantization
from kvpilot.engine.model.registry import gguf_source, model_fingerprint, resolve_model
from kvpilot.engine.model_runner import ModelRunner
from kvpilot.engine.native.ops import NativeOps

log = logging.getLogger(__name__)


@dataclass
class ServedModel:
    """One loaded model and what its forward runs on."""

    model_dir: Path
    arch: ModelArchConfig
    backend: AttentionBackend
    #: ``none``, ``gguf``, ``int8`` or ``fp8``: what the weights are kept as
    #: (docs/architecture.md#quantized-weights)
    quantization: str
    model: LlamaForCausalLM
    #: activations dtype (and the KV cache's for ``kv_cache_dtype="auto"``)
    dtype: torch.dtype
    #: ``auto``, ``fp8`` or ``int8``: what the KV cache stores (docs/architecture.md#kv-cache-dtype)
    kv_cache_dtype: str = "auto"
    #: this process's rank of a tensor-parallel model (docs/architecture.md#tensor-parallelism); None = whole
    tensor_parallel: TensorParallelRank | None = None
    #: ``int8``, ``fp8`` or ``none``: the quantized GEMMs' activations (``resolve_activation_quantization``)
    activation_quantization: str = "none"
    #: ``fp8_kv_scales``' result, read once
    _fp8_scales: tuple[list[tuple[float, float]] | None] | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        """Of this process's KV heads (a tensor-parallel rank's share)."""
        local = self.model.arch
        return kv_bytes_per_token(
            local.num_hidden_layers,
            local.num_key_value_heads,
            local.head_dim,
            storage_dtype(self.kv_cache_dtype, self.dtype).itemsize,
            scale_bytes_per_element_row(self.kv_cache_dtype, self.fp8_kv_scales() is not None),
        )

    def fp8_kv_scales(self) -> list[tuple[float, float]] | None:
        """The checkpoint's per-layer (k_scale, v_scale) for an fp8 cache (None: none, so scales per row)."""
        if self.kv_cache_dtype != "fp8" or not any(self.model_dir.glob("*.safetensors")):
            return None
        if self._fp8_scales is None:
            self._fp8_scales = (read_kv_scales(self.model_dir, self.arch.num_hidden_layers),)
        return self._fp8_scales[0]

    def identity(self) -> str:
        """The model's prefix-cache identity: quantized weights compute other K/V than float ones, so their
        hash chain is another one."""
        quantized = "" if self.quantization == "none" else f":{self.quantization}"
        if self.activation_quantization != "none":  # other rounding, other K/V
            quantized += f"+a{self.activation_quantization}"
        return f"{model_fingerprint(self.model_dir)}:{self.dtype}{quantized}"


def load_served_model(
    name: str,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    linear_backend: str,
    native_ops: NativeOps | None,
    quantization: str,
    tensor_parallel: TensorParallelRank | None = None,
) -> ServedModel:
    """Resolve ``name`` (a bundled name, a ``.gguf`` path or an HF directory) and load it on ``device``
    (only ``tensor_parallel``'s shard of it, when given)."""
    model_dir = resolve_model(name, cache_dir=config.model.download_dir)
    arch = ModelArchConfig.from_dir(model_dir)
    local = arch if tensor_parallel is None else tensor_parallel.shard.local_arch()
    backend = select_backend(
        config.attention_backend,
        device,
        num_heads=local.num_attention_heads,
        num_kv_heads=local.num_key_value_heads,
        head_dim=arch.head_dim,
        scale=arch.head_dim**-0.5,
        sliding_window=arch.sliding_window,
    )
    gguf_path = gguf_source(name)
    resolved = resolve_quantization(
        quantization, gguf_path, device, dtype, native_ops, model_dir, linear_backend
    )
    activations = resolve_activation_quantization(
        config.model.activation_quantization, resolved, device, native_ops, linear_backend
    )
    triton_gemm = linear_backend == "triton" and resolved in ("gguf", "int8")
    if device.type == "cuda" and (backend.name == "triton" or triton_gemm):
        # before the weights load and the first forward: an image without a C compiler (or Python.h,
        # libcuda) fails start-up in seconds, with a message naming what is missing
        from kvpilot.engine.attention.gpu_preflight import check_triton_launch

        check_triton_launch(device)
    if tensor_parallel is not None:
        check_tensor_parallel(arch, tensor_parallel.shard.size, resolved)
    model = load_model(
        model_dir,
        dtype,
        device,
        backend,
        linear_backend,
        batch_hint=min(config.scheduler.max_num_seqs, 64),
        native=native_ops,
        quantization=resolved,
        gguf_path=gguf_path,
        tensor_parallel=tensor_parallel,
        activation_quantization=activations,
    )
    if isinstance(backend, TorchAttentionBackend):
        backend.native = native_ops
    if device.type == "cuda" and backend.name == "triton" and native_ops is None:
        # the preflight above launched a Triton kernel: the layers' element-wise steps run as fused
        # Triton kernels too (one launch each instead of several PyTorch ops)
        from kvpilot.engine.model.fused_triton import TritonFusedOps

        model.fused_ops = TritonFusedOps()
    return ServedModel(
        model_dir,
        arch,
        backend,
        resolved,
        model,
        dtype,
        config.cache.kv_cache_dtype,
        tensor_parallel,
        activation_quantization=activations,
    )


@dataclass
class PagedKV:
    """The paged KV cache and the bookkeeping over it."""

    kv_cache: KVCache
    pool: BlockPool
    kv: KVCacheManager
    #: the persistent batch's block tables (docs/architecture.md#persistent-batch)
    block_tensor: BlockTableTensor
    max_model_len: int
    #: how the cache was sized (``/load``, ``kvpilot_cache_config_info``)
    sizing: str


def build_paged_kv(
    config: EngineConfig,
    target: ServedModel,
    device: torch.device,
    memory: tuple[DeviceMemory | None, MemoryBaseline | None],
    kv_events: KVEventLog,
    extra_bytes_per_token: int = 0,
    kv_ops: list[KVOp] | None = None,
) -> PagedKV:
    """Size the cache (a fixed size, the CPU default, or what a profiled step leaves on a GPU) and build it.
    ``memory``: ``memory_baseline``'s result; ``extra_bytes_per_token``: another cache over the same blocks
    (a draft model's); ``kv_ops``: rank 0 of a tensor-parallel model records its block copies and swaps
    there for the workers (``distributed.kv_replica``)."""
    mc, cc, sc = config.model, config.cache, config.scheduler
    arch, dtype = target.arch, target.dtype
    device_memory, baseline = memory
    sizing = kv_cache_sizing(cc, device)
    profiled_budget = None
    if device_memory is not None and baseline is not None:
        tp = target.tensor_parallel
        # rank 0 profiles its shard's step alone: every rank's shard is the same size
        with tp.group.local_only() if tp is not None else contextlib.nullcontext():
            profiled_budget = profiled_kv_budget(
                target.model,
                device_memory,
                baseline,
                device=device,
                dtype=dtype,
                block_size=cc.block_size,
                max_num_batched_tokens=sc.max_num_batched_tokens,
                max_num_seqs=sc.max_num_seqs,
                max_model_len=mc.max_model_len or arch.max_position_embeddings,
                kv_layout=target.backend.kv_cache_layout,
                utilization=cc.gpu_memory_utilization,
                kv_cache_dtype=cc.kv_cache_dtype,
            )
        sizing = "gpu_memory_utilization"
    per_token = target.kv_bytes_per_token
    num_blocks = plan_num_kv_blocks(cc, per_token + extra_bytes_per_token, profiled_budget)
    log.info(
        "KV cache: %d blocks of %d tokens (%.2f GiB of %s, sized by %s)",
        num_blocks,
        cc.block_size,
        num_blocks * cc.block_size * per_token / (1 << 30),
        cc.kv_cache_dtype,
        sizing,
    )
    max_model_len = plan_max_model_len(
        mc.max_model_len, arch.max_position_embeddings, (num_blocks - 1) * cc.block_size
    )
    layout = target.backend.kv_cache_layout
    shape = (arch.num_hidden_layers, num_blocks, cc.block_size, target.model.arch.num_key_value_heads)
    scales = target.fp8_kv_scales()
    kv_cache = (
        KVCache(*shape, arch.head_dim, dtype, device, layout, cc.kv_cache_dtype, scales)
        if kv_ops is None
        else RecordingKVCache(
            *shape, arch.head_dim, dtype, device, layout, cc.kv_cache_dtype, scales, ops=kv_ops
        )
    )
    swap = None
    if cc.swap_space > 0:
        swap_blocks = max(1, int(cc.swap_space * (1 << 30)) // (per_token * cc.block_size))
        swap = (
            HostSwapSpace(kv_cache, swap_blocks)
            if kv_ops is None
            else RecordingSwapSpace(kv_cache, swap_blocks, kv_ops)
        )
    pool = BlockPool(num_blocks, cc.enable_prefix_caching, kv_events)
    block_tensor = BlockTableTensor(sc.max_num_seqs, blocks_for_tokens(max_model_len, cc.block_size), device)
    kv = KVCacheManager(pool, cc.block_size, root_hash(target.identity()), kv_cache, swap, block_tensor)
    return PagedKV(kv_cache, pool, kv, block_tensor, max_model_len, sizing)


def build_runner(
    config: EngineConfig,
    target: ServedModel,
    paged: PagedKV,
    device: torch.device,
    tp_workers: TensorParallelWorkers | None,
    kv_ops: list[KVOp] | None,
) -> ModelRunner:
    """The runner over the persistent batch: one process's, with its decode graphs (None where they are
    off), or rank 0's of a tensor-parallel model, whose step runs eagerly on every rank."""
    input_batch = InputBatch(paged.block_tensor, paged.max_model_len, config.cache.block_size, device)
    if tp_workers is None or kv_ops is None:
        runner = ModelRunner(target.model, paged.kv_cache, device, input_batch)
        runner.decode_graphs = decode_graphs_for(target.model, paged.kv_cache, paged.max_model_len, config)
        return runner
    return TensorParallelRunner(
        target.model, paged.kv_cache, device, input_batch, tp_workers, kv_ops, target.arch.vocab_size
    )


def memory_baseline(
    config: EngineConfig, device: torch.device, device_memory: DeviceMemory | None
) -> tuple[DeviceMemory | None, MemoryBaseline | None]:
    """(device memory to profile, its baseline before any weights load) — (None, None) when the cache has a
    fixed size or lives on the CPU."""
    sizing = kv_cache_sizing(config.cache, device)
    if sizing in ("num_kv_blocks", "kv_cache_memory_bytes"):
        return None, None  # a fixed size: nothing to profile
    if device_memory is None and sizing == "gpu_memory_utilization":
        device_memory = CudaMemory(device)
    # taken before the weights load: what other processes use
    return device_memory, (take_baseline(device_memory) if device_memory is not None else None)
