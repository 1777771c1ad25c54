"""Which weights the engine keeps quantized (``quantization``), and putting them into the model
(docs/architecture.md#quantized-weights).

- ``none``: float weights in ``dtype`` (a GGUF is dequantized, as its conversion wrote it);
- ``gguf``: the projections, the embedding and MoE layers' routed experts (``moe_quant``) keep the GGUF's
  own blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K); a tensor in another format keeps float weights, and the log
  names it;
- ``int8``: every projection, the LM head and the embedding quantized at load, per output row, from the
  float checkpoint (any model);
- ``gguf`` and ``int8`` GEMMs run the Triton kernel with ``linear_backend='triton'`` (the default on
  CUDA; float32/float16/bfloat16 activations), else the C kernels (float32 on CPU);
- ``fp8`` (CUDA): the decoder's projections as e4m3 with scales (``fp8_linear``): an fp8 checkpoint's own
  bytes, or a float checkpoint quantized per row at load;
- ``auto`` (default): ``gguf`` for a GGUF model where the kernels run (``linear_backend='triton'``, or
  float32 on CPU with the native kernels), ``fp8`` for an fp8 checkpoint on CUDA, else ``none``, saying
  why in the log (an fp8 checkpoint is then dequantized to ``dtype`` at load).

A checkpoint quantized otherwise (AWQ, GPTQ, …) is refused by ``fp8_checkpoint.read_checkpoint_quantization``.

``activation_quantization`` (``resolve_activation_quantization``): ``int8`` runs the ``gguf`` / ``int8``
weights' C GEMMs with activations rounded to int8 per 32 inputs (``quant_vnni.c``: AVX-512 VNNI, or AVX2), the
default where the CPU has it; ``fp8`` runs ``fp8`` weights' Triton GEMM as W8A8 (``fp8_triton``, opt-in);
``none`` keeps the activations' dtype.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from kvpilot.engine.model.fp8_checkpoint import read_checkpoint_quantization
from kvpilot.engine.model.fp8_linear import Fp8Linear, w8a8_supported
from kvpilot.engine.model.gguf_weights import GGUFWeights
from kvpilot.engine.model.moe import SparseMoeBlock
from kvpilot.engine.model.moe_quant import QuantExperts
from kvpilot.engine.model.quant_formats import quantize_int8
from kvpilot.engine.model.quant_linear import QuantEmbedding, QuantLinear, SplitQuantLinear
from kvpilot.engine.native.ops import NativeOps

log = logging.getLogger(__name__)


def resolve_quantization(
    requested: str,
    gguf_path: Path | None,
    device: torch.device,
    dtype: torch.dtype,
    native: NativeOps | None,
    model_dir: Path | None = None,
    linear_backend: str = "torch",
) -> str:
    """``none``, ``gguf``, ``int8`` or ``fp8`` for the engine argument ``requested`` and the model in
    ``model_dir`` (the module docstring), with the resolved ``linear_backend`` (``triton``: the quantized
    GEMMs run the Triton kernel, any float dtype); ``ValueError`` when an explicit choice cannot run here,
    or the checkpoint's own quantization cannot be loaded."""
    checkpoint = read_checkpoint_quantization(model_dir) if model_dir is not None else None
    triton = linear_backend == "triton"
    # e4m3 weights run the Triton W8A16 GEMM (on CPU: in the interpreter, tests) or, on CUDA with another
    # backend, dequantized per call
    fp8_runs = device.type == "cuda" or triton
    if checkpoint is not None:
        return _resolve_for_fp8_checkpoint(requested, checkpoint.describe(), device, dtype, fp8_runs)
    if requested == "fp8":
        if not fp8_runs:
            raise ValueError(
                f"quantization='fp8' keeps e4m3 weights on CUDA (or with linear_backend='triton'); the "
                f"device is {device}"
            )
        return "fp8"
    if requested == "none":
        return "none"
    on_cpu_kernels = device.type == "cpu" and dtype == torch.float32
    if requested == "auto":
        if gguf_path is None:
            return "none"
        if triton or (on_cpu_kernels and native is not None):
            return "gguf"
        why = (
            "the C kernels could not be built"
            if on_cpu_kernels
            else f"the C kernels run float32 on CPU, not {dtype} on {device}, and the Triton GEMM needs "
            f"linear_backend='triton' (got {linear_backend!r})"
        )
        log.info("GGUF weights dequantized to %s: the quantized kernels are unavailable (%s)", dtype, why)
        return "none"
    if requested == "gguf" and gguf_path is None:
        raise ValueError(
            "quantization='gguf' needs a GGUF model (a .gguf path or smollm2-135m); "
            "use quantization='int8' to quantize a float checkpoint"
        )
    if triton:
        return requested
    if not on_cpu_kernels:
        raise ValueError(
            f"quantization={requested!r} with linear_backend={linear_backend!r} runs float32 activations on "
            f"CPU (the C kernels); got {dtype} on {device}: use linear_backend='triton' (the default on "
            "CUDA), dtype='float32' and device='cpu', or quantization='none'"
        )
    if native is None:
        log.warning(
            "quantization=%r without the native C kernels: every forward dequantizes each weight with "
            "PyTorch ops (correct, several times slower than float32)",
            requested,
        )
    return requested


def resolve_activation_quantization(
    requested: str, quantization: str, device: torch.device, native: NativeOps | None, linear_backend: str
) -> str:
    """``int8``, ``fp8`` or ``none`` for the engine argument ``requested`` and the resolved
    ``quantization``: ``fp8`` needs ``fp8`` weights on the Triton GEMM (``auto`` never picks it);
    ``int8`` needs ``gguf`` / ``int8`` weights on the C kernels (CPU, not ``linear_backend='triton'``) of a
    build with the int8-activation kernel (AVX-512 VNNI or AVX2), and ``auto`` picks it there.
    ``ValueError`` when the choice cannot run."""
    if requested == "none":
        return "none"
    if requested == "fp8" or quantization == "fp8":
        # W8A8 is opt-in: W8A16 stays the default until measured on an fp8 GPU
        if requested == "fp8" and (quantization != "fp8" or linear_backend != "triton"):
            raise ValueError(
                "activation_quantization='fp8' (W8A8) runs fp8 weights on the Triton GEMM; the weights are "
                f"{quantization!r} with linear_backend={linear_backend!r}: use quantization='fp8' with "
                "linear_backend='triton' (the CUDA default), or activation_quantization 'auto' / 'none'"
            )
        if requested == "int8":
            raise ValueError(
                "activation_quantization='int8' applies to quantization 'gguf' or 'int8' on the CPU's C "
                "kernels; fp8 weights take 'fp8' (W8A8) or 'none' (W8A16)"
            )
        return "fp8" if requested == "fp8" else "none"
    where = quantization in ("gguf", "int8") and device.type == "cpu" and linear_backend != "triton"
    if where and native is not None and native.vnni.available:
        return "int8"
    if requested == "int8":
        why = (
            f"the weights are {quantization!r} on {device} with linear_backend={linear_backend!r}; it "
            "applies to quantization 'gguf' or 'int8' on the CPU's C kernels"
            if not where
            else "this CPU (or the C kernels' build) has no int8-activation kernel (AVX-512 VNNI or AVX2)"
            if native is not None
            else "the native C kernels are off or could not be built"
        )
        raise ValueError(f"activation_quantization='int8' cannot run here: {why}; use 'auto' or 'none'")
    return "none"


def use_fp8_activations(model: nn.Module) -> tuple[int, list[str]]:
    """W8A8 for every ``Fp8Linear`` of ``model`` whose scale groups fit the kernel's K steps; returns how
    many, and the names of the others (kept W8A16)."""
    count, kept = 0, []
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            if w8a8_supported(module.block_k, module.in_features):
                module.fp8_activations = True
                count += 1
            else:
                kept.append(f"{name} (scale groups of {module.block_k})")
    return count, kept


def use_int8_activations(model: nn.Module) -> int:
    """Put every quantized linear of ``model`` (the LM head and MoE experts included) that the
    int8-activation GEMM can run on it; returns how many. The decoder layers' attention and dense MLP
    projections then free their stored blocks (only the packed tiles are read), so those weights are held
    once; the embedding (and its tied head) and experts keep theirs (lookups and the experts' reference
    read them)."""
    count = sum(
        module.use_int8_activations() for module in model.modules() if isinstance(module, QuantLinear)
    )
    for layer in getattr(model, "layers", ()):
        owners = (("self_attn", ("qkv_proj", "o_proj")), ("mlp", ("gate_up_proj", "down_proj")))
        for owner, names in owners:
            for name in names:
                proj = getattr(getattr(layer, owner, None), name, None)
                for part in proj.parts if isinstance(proj, SplitQuantLinear) else [proj]:
                    if isinstance(part, QuantLinear) and part.vnni_weight is not None:
                        part.release_stored_blocks()
    return count


def _resolve_for_fp8_checkpoint(
    requested: str, described: str, device: torch.device, dtype: torch.dtype, fp8_runs: bool
) -> str:
    """An fp8 checkpoint keeps its e4m3 bytes on CUDA (``fp8``), else loads dequantized (``none``)."""
    if requested in ("gguf", "int8"):
        raise ValueError(
            f"quantization={requested!r}: the checkpoint is already quantized ({described}); use "
            "quantization='auto' (e4m3 kept on CUDA, dequantized elsewhere) or 'none'"
        )
    if requested == "fp8" and not fp8_runs:
        raise ValueError(
            f"quantization='fp8' keeps e4m3 weights on CUDA; on {device} use 'auto' or 'none' to load this "
            f"checkpoint ({described}) dequantized to {dtype}"
        )
    if requested != "none" and fp8_runs:
        return "fp8"
    why = (
        "quantization='none'" if requested == "none" else f"e4m3 weights are kept on CUDA only, not {device}"
    )
    log.info("fp8 checkpoint (%s) dequantized to %s at load: %s", described, dtype, why)
    return "none"


def install_gguf_weights(
    model: nn.Module, weights: GGUFWeights, native: NativeOps | None, triton: bool = False
) -> None:
    """Replace the model's projections and embedding by quantized layers on ``weights``' blocks, before the
    float checkpoint is loaded (which then skips them); a tied LM head shares the embedding's blocks.
    ``triton``: their GEMMs run the Triton kernel (``linear_backend='triton'``)."""
    for path, weight in weights.weights.items():
        parent, name = _parent(model, path)
        old = getattr(parent, name)
        if isinstance(old, nn.Embedding):
            setattr(parent, name, QuantEmbedding(weight, old.weight.dtype))
        else:
            setattr(parent, name, QuantLinear(weight, old.bias is not None, native, triton))
    for path, parts in weights.split.items():
        parent, name = _parent(model, path)
        fused = SplitQuantLinear(parts, getattr(parent, name).bias is not None, native, triton)
        setattr(parent, name, fused)
    for path, (gate_up, down) in weights.experts.items():
        block = model.get_submodule(path)
        assert isinstance(block, SparseMoeBlock), f"{path}: GGUF experts are read for sparse layers only"
        block.keep_quantized_experts(QuantExperts(gate_up, down, native, triton))
    if weights.dequantized:
        shown = ", ".join(f"{p} ({t})" for p, t in list(weights.dequantized.items())[:6])
        more = len(weights.dequantized) - 6
        log.info(
            "GGUF tensors without a quantized kernel kept in float: %s%s",
            shown,
            f" and {more} more" if more > 0 else "",
        )


def quantize_linears_int8(model: nn.Module, native: NativeOps | None, triton: bool = False) -> int:
    """Replace every float projection and the embedding (and an untied LM head) by int8 layers quantized
    from their loaded weights; returns how many."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                layer = QuantLinear(quantize_int8(child.weight), child.bias is not None, native, triton)
                if child.bias is not None and layer.bias is not None:  # the layer has one iff the child has
                    layer.bias.copy_(child.bias.detach())
                setattr(module, name, layer)
                count += 1
            elif isinstance(child, nn.Embedding):
                setattr(module, name, QuantEmbedding(quantize_int8(child.weight), child.weight.dtype))
                count += 1
    return count


def quantized_lm_head(model: nn.Module, native: NativeOps | None, triton: bool = False) -> nn.Module | None:
    """The quantized LM head the logits use: the untied ``lm_head`` if quantized, else a head over the
    quantized embedding when tied; None when the head's weight is float."""
    lm_head = getattr(model, "lm_head", None)
    if isinstance(lm_head, QuantLinear):
        return lm_head
    if lm_head is None and isinstance(model.embed_tokens, QuantEmbedding):
        return model.embed_tokens.as_linear(native, triton)
    return None


def weights_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, each storage counted once (shared blocks, tied heads)."""
    seen: dict[object, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_mkldnn:  # oneDNN's packed weights are opaque: count their elements
            seen[id(tensor)] = tensor.numel() * tensor.element_size()
            continue
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _parent(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    head, _, name = path.rpartition(".")
    return (model.get_submodule(head) if head else model), name
