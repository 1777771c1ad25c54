"""Build the model on its device from a resolved HF-format directory."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from kvpilot.engine.attention.backend import AttentionBackend
from kvpilot.engine.distributed.layers import install_tensor_parallel
from kvpilot.engine.distributed.quant_shards import shard_quant_weights
from kvpilot.engine.distributed.sharding import ShardedCheckpoint, TensorParallelRank
from kvpilot.engine.model.arch import ModelArchConfig
from kvpilot.engine.model.cpu_linear import PackedLinear, onednn_available, pack_linears
from kvpilot.engine.model.fp8_checkpoint import (
    Fp8Checkpoint,
    install_fp8_weights,
    quantize_linears_fp8,
    read_checkpoint_quantization,
)
from kvpilot.engine.model.gguf_weights import read_gguf_weights
from kvpilot.engine.model.llama import LlamaForCausalLM
from kvpilot.engine.model.moe import configure_moe
from kvpilot.engine.model.quantization import (
    install_gguf_weights,
    quantize_linears_int8,
    quantized_lm_head,
    use_fp8_activations,
    use_int8_activations,
    weights_bytes,
)
from kvpilot.engine.native.build import NativeBuildError
from kvpilot.engine.native.ops import NativeOps, load_native_ops

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is float32 on CPU (fast, exact) and bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return TORCH_DTYPES[dtype]


def resolve_linear_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` = oneDNN-packed weights for float32 on CPU (when torch has oneDNN), ``triton`` on CUDA (the
    quantized weights' GEMMs; float ones are plain torch there too), plain torch otherwise."""
    if name == "auto":
        if device.type == "cuda":
            return "triton"
        return "onednn" if device.type == "cpu" and dtype == torch.float32 and onednn_available() else "torch"
    if name == "onednn" and (device.type != "cpu" or not onednn_available()):
        raise ValueError("linear_backend 'onednn' needs a CPU device and a torch build with oneDNN")
    if name == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "linear_backend 'triton' on CPU runs only in Triton's interpreter (TRITON_INTERPRET=1 set before "
            "Triton is imported, as the tests do); use 'auto' on CPU, or a CUDA device"
        )
    return name


def resolve_native_ops(
    mode: str, device: torch.device, dtype: torch.dtype, cache_dir: Path
) -> NativeOps | None:
    """The fused C kernels for ``native_cpu_ops`` = ``mode``, or None to run PyTorch ops.

    They exist for float32 on CPU only; ``auto`` falls back (with a warning) when they cannot be built,
    ``on`` raises instead."""
    if mode == "off":
        return None
    if device.type != "cpu" or dtype != torch.float32:
        if mode == "on":
            raise ValueError(f"native_cpu_ops='on' needs float32 on CPU, not {dtype} on {device}")
        return None
    try:
        return load_native_ops(cache_dir)
    except NativeBuildError as err:
        if mode == "on":
            raise ValueError(f"native_cpu_ops='on' but the C kernels cannot be built: {err}") from err
        log.warning("native CPU kernels unavailable, using PyTorch ops (slower): %s", err)
        return None


def resolve_device(device: str) -> torch.device:
    """The engine's device; a CUDA device gets its index (``cuda`` = the current one) and becomes the current
    device, because Triton launches and ``torch.cuda`` calls without a device go to the current one."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available on this machine")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= count:
        raise ValueError(f"device {device!r} requested but this machine has {count} CUDA device(s)")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


class SafetensorsCheckpoint(Mapping[str, torch.Tensor]):
    """The tensors of a directory's ``*.safetensors`` files, read one at a time when looked up.

    The files stay open (memory-mapped by safetensors); a lookup reads that one tensor into host memory.
    Copying each into a parameter that already lives on the device keeps the host's peak near one fused
    tensor (q/k/v or gate/up of a layer) instead of the whole checkpoint beside the model."""

    def __init__(self, model_dir: Path) -> None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{model_dir}: no *.safetensors weight files")
        self._stack = contextlib.ExitStack()
        self._where: dict[str, Any] = {}
        for f in files:
            handle = self._stack.enter_context(safe_open(str(f), framework="pt"))
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                self._where[name] = handle

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def close(self) -> None:
        self._stack.close()


@contextlib.contextmanager
def _uninitialized_parameters(dtype: torch.dtype) -> Iterator[None]:
    """Allocate parameters in ``dtype`` without running their random initialisers: every parameter is
    overwritten by the checkpoint, and initialising 100M+ weights costs seconds. (The meta-device route
    would import torch's whole decomposition machinery, which costs more than it saves.)"""
    saved = [(cls, cls.reset_parameters) for cls in (nn.Linear, nn.Embedding)]
    old_dtype = torch.get_default_dtype()
    try:
        # setattr: mypy refuses assigning to a method, which patching the class for a while is
        for cls, _ in saved:
            setattr(cls, "reset_parameters", lambda self: None)  # noqa: B010
        torch.set_default_dtype(dtype)
        yield
    finally:
        torch.set_default_dtype(old_dtype)
        for cls, fn in saved:
            setattr(cls, "reset_parameters", fn)  # noqa: B010


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
    linear_backend: str = "torch",
    batch_hint: int = 32,
    native: NativeOps | None = None,
    quantization: str = "none",
    gguf_path: Path | None = None,
    tensor_parallel: TensorParallelRank | None = None,
    activation_quantization: str = "none",
) -> LlamaForCausalLM:
    """The model with its weights on ``device``; ``native`` (float32 CPU kernels) is attached to the
    forward pass and, with oneDNN linears, serves their small batches. ``quantization`` is a resolved
    ``quantization.resolve_quantization`` choice; ``gguf`` reads its blocks from ``gguf_path``; with
    ``linear_backend='triton'`` the quantized layers' GEMMs run the Triton kernel.
    ``tensor_parallel``: build and fill only that rank's shard (docs/architecture.md#tensor-parallelism).
    ``activation_quantization`` (resolved): ``int8`` runs the quantized linears on the int8-activation GEMM,
    ``fp8`` the fp8 ones as W8A8."""
    full_arch = arch = ModelArchConfig.from_dir(model_dir)
    triton = linear_backend == "triton"
    if tensor_parallel is not None:
        arch = tensor_parallel.shard.local_arch()
    # parameters are allocated on the device and filled tensor by tensor from the open files: the host
    # never holds the whole checkpoint (nor a CPU copy of the model on its way to a GPU)
    with _uninitialized_parameters(dtype), torch.device(device):
        model = LlamaForCausalLM(arch, dtype, backend)
    if quantization == "gguf":
        # before the float weights load, so the float copies of these tensors are never read
        if gguf_path is None:
            raise ValueError("quantization='gguf' needs the GGUF file (gguf_path)")
        gguf = read_gguf_weights(gguf_path, full_arch)
        if tensor_parallel is not None:  # the rank's rows and block columns of the stored blocks
            gguf.weights = shard_quant_weights(gguf.weights, tensor_parallel.shard)
            # mixed-format fused parts are not sharded as blocks: their float copies are
            gguf.dequantized |= {
                path: "+".join(p.format.name for p in parts) for path, parts in gguf.split.items()
            }
            gguf.split = {}
        install_gguf_weights(model, gguf, native, triton)
    fp8_quant = read_checkpoint_quantization(model_dir)
    checkpoint = SafetensorsCheckpoint(model_dir)
    # an fp8 checkpoint's e4m3 weights read dequantized, except those Fp8Linear layers keep as stored
    tensors: Mapping[str, torch.Tensor] = (
        checkpoint if fp8_quant is None else Fp8Checkpoint(checkpoint, fp8_quant)
    )
    if tensor_parallel is not None:
        tensors = ShardedCheckpoint(tensors, tensor_parallel.shard)
    try:
        if quantization == "fp8" and isinstance(tensors, Fp8Checkpoint):
            install_fp8_weights(model, tensors, device, dtype, triton)
        model.load_hf_weights(tensors)
    finally:
        checkpoint.close()
    if quantization == "int8":
        quantize_linears_int8(model, native, triton)
    elif quantization == "fp8" and fp8_quant is None:
        quantize_linears_fp8(model, triton)
    model.to(device)  # the RoPE tables, built on the CPU
    head = quantized_lm_head(model, native, triton)
    if head is not None:
        model.packed_lm_head = head
    if tensor_parallel is not None:  # before packing: the packed linears are the shards' own
        install_tensor_parallel(model, tensor_parallel.shard, tensor_parallel.group)
    if linear_backend == "onednn":
        pack_linears(model.layers, batch_hint, native)
        # the LM head is the widest GEMM of a decode step; with tied embeddings each packed copy (oneDNN's,
        # and the native GEMM's panels when ``native`` is set) costs vocab × hidden floats more memory
        # (113 MB each for SmolLM2) and the lookup keeps the plain weight
        if head is None:
            head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False, device="meta")
            weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
            assert isinstance(weight, torch.Tensor), "a quantized LM head is quantized_lm_head's"
            head.weight = weight
            model.packed_lm_head = PackedLinear(head, batch_hint, native)
    model.native = native
    if activation_quantization == "int8":
        count = use_int8_activations(model)
        isa = native.vnni.isa if native is not None else None
        log.info(
            "int8 activations: %d quantized linears repacked for the int8-activation GEMM (%s)", count, isa
        )
    elif activation_quantization == "fp8":
        count, kept = use_fp8_activations(model)
        log.info("fp8 activations (W8A8): %d linears; kept W8A16: %s", count, ", ".join(kept) or "none")
    # routed experts: the fused Triton kernel beside the Triton attention backend, else the sorted path
    configure_moe(model, "triton" if backend.name == "triton" else "sorted", native)
    model.eval()
    log.info(
        "weights: %.1f MiB in memory (quantization %s, linear backend %s)",
        weights_bytes(model) / (1 << 20),
        quantization,
        linear_backend,
    )
    return model
