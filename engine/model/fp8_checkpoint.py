"""HF checkpoints with a ``quantization_config`` in config.json (docs/architecture.md#quantized-weights).

Loaded, under vLLM's method names (``vllm/model_executor/layers/quantization``):
- ``quant_method: "fp8"`` (vLLM's ``Fp8Config``: AutoFP8, HF's FineGrainedFP8, DeepSeek-V3): e4m3 ``weight``
  tensors with a per-tensor ``weight_scale``, or, with ``weight_block_size: [bn, bk]``, a block-wise
  ``weight_scale_inv`` ``[ceil(N/bn), ceil(K/bk)]`` (a multiplier despite its name, as DeepSeek's
  ``weight_dequant`` and vLLM apply it); ``activation_scheme: "static"`` adds ``input_scale`` tensors;
- ``quant_method: "compressed-tensors"`` (llm-compressor) whose weight groups are 8-bit floats (schemes
  FP8, FP8_DYNAMIC, FP8_BLOCK; ``format: "float-quantized"``): ``weight_scale`` ``[1]`` (strategy tensor),
  ``[N, 1]`` (channel) or block-wise (strategy block, ``block_structure: [bn, bk]``).
Layers a checkpoint leaves in float (``ignored_layers``, ``ignore: ["lm_head"]``) are found by dtype. Every
other method (AWQ, GPTQ, int4/int8 compressed-tensors, bitsandbytes, …) is refused, naming it and what loads.

``Fp8Checkpoint`` is the checkpoint as the loader sees it: an e4m3 ``weight`` reads as its float32
dequantization (the CPU path, and any layer the engine keeps in float) and the scale tensors are consumed
with their weight; ``install_fp8_weights`` puts the projections' e4m3 bytes into ``Fp8Linear`` layers instead
(``quantization=fp8``, CUDA).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvpilot.engine.model.fp8_linear import (
    FP8_DTYPE,
    Fp8Linear,
    Fp8Weight,
    concat_fp8_rows,
    dequantize_fp8,
    expand_scales,
    quantize_fp8,
)
from kvpilot.engine.model.moe import SparseMoeBlock

if TYPE_CHECKING:
    from kvpilot.engine.model.llama import LlamaForCausalLM

#: checkpoint tensors that belong to a quantized weight rather than to a parameter
_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale")
SUPPORTED = (
    "fp8 checkpoints (quant_method 'fp8', or 'compressed-tensors' with 8-bit float weights), GGUF files "
    "(Q4_0/Q4_1/Q8_0/Q4_K/Q6_K kept, other types dequantized) and float checkpoints (quantization='int8' "
    "quantizes them at load, 'fp8' on CUDA)"
)


@dataclass(frozen=True)
class CheckpointQuantization:
    """What a checkpoint's ``quantization_config`` says about its weights."""

    #: the config's ``quant_method``: ``fp8`` or ``compressed-tensors``
    method: str
    #: ``(bn, bk)`` of a block-wise scale; None for per-tensor or per-channel scales
    block: tuple[int, int] | None
    #: ``static`` (``input_scale`` tensors, unused: activations stay in their dtype) or ``dynamic``
    activation_scheme: str

    def describe(self) -> str:
        scales = "per-tensor/per-channel scales" if self.block is None else f"{list(self.block)} block scales"
        return f"{self.method} e4m3 weights with {scales}"


def read_checkpoint_quantization(model_dir: Path) -> CheckpointQuantization | None:
    """The fp8 ``quantization_config`` of ``model_dir``'s config.json, None without one; ``ValueError``
    naming the format for every other quantized checkpoint."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        return None
    qc = json.loads(config_path.read_text()).get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise _unsupported(model_dir, f"fp8 with fmt {fmt!r}")
        return CheckpointQuantization(
            "fp8", _block(qc.get("weight_block_size"), model_dir), qc.get("activation_scheme", "dynamic")
        )
    if method == "compressed-tensors":
        return _compressed_tensors(qc, model_dir)
    bits = qc.get("bits", qc.get("w_bit"))
    detail = f"{method} int{bits}" if bits else (method or "without a quant_method")
    if qc.get("group_size") or qc.get("q_group_size"):
        detail += f", group size {qc.get('group_size', qc.get('q_group_size'))}"
    raise _unsupported(model_dir, detail)


def _compressed_tensors(qc: dict, model_dir: Path) -> CheckpointQuantization:
    blocks, static = set(), False
    for name, group in (qc.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
        if kind != "float" or bits != 8 or strategy not in ("tensor", "channel", "block"):
            raise _unsupported(
                model_dir,
                f"compressed-tensors {qc.get('format', '')} with {kind}{bits} weights "
                f"(group {name}, strategy {strategy})",
            )
        blocks.add(_block(weights.get("block_structure"), model_dir) if strategy == "block" else None)
        activations = group.get("input_activations") or {}
        static = static or (bool(activations) and not activations.get("dynamic", True))
    if not blocks:
        raise _unsupported(model_dir, "compressed-tensors without config_groups")
    if len(blocks - {None}) > 1:
        raise _unsupported(model_dir, f"compressed-tensors with several block structures {blocks}")
    block = next(iter(blocks - {None}), None)
    return CheckpointQuantization("compressed-tensors", block, "static" if static else "dynamic")


def _block(value: object, model_dir: Path) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value):
        return value[0], value[1]
    raise ValueError(f"{model_dir}/config.json: a weight block size must be [rows, cols], got {value!r}")


def _unsupported(model_dir: Path, detail: str) -> ValueError:
    return ValueError(
        f"{model_dir}: the checkpoint is quantized as {detail} (config.json quantization_config), which "
        f"kvpilot does not load; it loads {SUPPORTED}"
    )


class Fp8Checkpoint(Mapping[str, torch.Tensor]):
    """``tensors`` (a checkpoint quantized as ``quant``) with each e4m3 weight read as float32 and its scale
    tensors hidden (module docstring)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], quant: CheckpointQuantization) -> None:
        self.tensors, self.quant = tensors, quant
        self._names = [n for n in tensors if not n.endswith(_SCALE_SUFFIXES)]
        #: how many e4m3 weights were read dequantized
        self.dequantized = 0

    def fp8_weight(self, name: str) -> Fp8Weight | None:
        """The e4m3 weight ``name`` with its scales; None when the checkpoint keeps it in float."""
        return self._split(name, self.tensors[name])

    def _split(self, name: str, tensor: torch.Tensor) -> Fp8Weight | None:
        if not tensor.dtype.is_floating_point or tensor.dtype.itemsize != 1:
            return None
        if tensor.dtype != FP8_DTYPE or tensor.dim() != 2:
            raise ValueError(
                f"tensor {name!r} is {tensor.dtype} {list(tensor.shape)}; kvpilot reads 2-D e4m3"
            )
        prefix = name.removesuffix("weight")
        scale_name = next(
            (prefix + s for s in ("weight_scale_inv", "weight_scale") if prefix + s in self.tensors), None
        )
        if scale_name is None:
            raise ValueError(f"e4m3 tensor {name!r} has no {prefix}weight_scale(_inv) beside it")
        rows, cols = tensor.shape
        scales, block_k = expand_scales(self.tensors[scale_name], rows, cols, self.quant.block, scale_name)
        return Fp8Weight(tensor, scales, block_k)

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self.tensors[name]
        weight = self._split(name, tensor) if name.endswith("weight") else None
        if weight is None:
            return tensor
        self.dequantized += 1
        return dequantize_fp8(weight)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and not name.endswith(_SCALE_SUFFIXES) and name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def projection_tensors(model: LlamaForCausalLM) -> dict[str, list[str]]:
    """Module path of each dense projection → the checkpoint weights whose rows make it, in order (as
    ``weights.load_hf_weights`` fuses them)."""
    arch, out = model.arch, {}
    for i, layer in enumerate(model.decoder_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        out[f"layers.{i}.self_attn.qkv_proj"] = (
            [a + "qkv_proj.weight"] if arch.fused_checkpoint else [a + f"{n}_proj.weight" for n in "qkv"]
        )
        out[f"layers.{i}.self_attn.o_proj"] = [a + "o_proj.weight"]
        if isinstance(layer.mlp, SparseMoeBlock):
            continue  # experts are stacked tensors: they read dequantized
        out[f"layers.{i}.mlp.gate_up_proj"] = (
            [m + "gate_up_proj.weight"]
            if arch.fused_checkpoint
            else [m + "gate_proj.weight", m + "up_proj.weight"]
        )
        out[f"layers.{i}.mlp.down_proj"] = [m + "down_proj.weight"]
    return out


def install_fp8_weights(
    model: LlamaForCausalLM,
    checkpoint: Fp8Checkpoint,
    device: torch.device,
    dtype: torch.dtype,
    triton: bool = False,
) -> int:
    """Replace every projection whose checkpoint weights are all e4m3 by an ``Fp8Linear`` on ``device``,
    before the rest loads (which then skips it); returns how many. ``triton``: their GEMMs run the Triton
    W8A16 kernel."""
    count = 0
    for path, names in projection_tensors(model).items():
        missing = [n for n in names if n not in checkpoint]
        if missing:
            raise ValueError(f"checkpoint is missing tensor {missing[0]!r}")
        parts = [checkpoint.fp8_weight(n) for n in names]
        if any(p is None for p in parts):
            continue  # left in float by the checkpoint (ignored layers): loads as a float layer
        head, _, name = path.rpartition(".")
        parent = model.get_submodule(head)
        old = getattr(parent, name)
        weight = concat_fp8_rows([p for p in parts if p is not None]).to(device)
        setattr(parent, name, Fp8Linear(weight, old.bias is not None, dtype, triton))
        count += 1
    return count


def quantize_linears_fp8(model: LlamaForCausalLM, triton: bool = False) -> int:
    """Replace every float projection of the decoder layers by an ``Fp8Linear`` quantized per row from its
    loaded weight (a float checkpoint under ``quantization=fp8``); the embedding and LM head stay in float,
    as vLLM keeps them. Returns how many. ``triton``: their GEMMs run the Triton W8A16 kernel."""
    count = 0
    for module in list(model.layers.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                weight = quantize_fp8(child.weight)
                layer = Fp8Linear(weight, child.bias is not None, child.weight.dtype, triton)
                if child.bias is not None and layer.bias is not None:  # the layer has one iff the child has
                    layer.bias.copy_(child.bias.detach())
                setattr(module, name, layer)
                count += 1
    return count
