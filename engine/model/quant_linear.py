"""Linear and embedding layers on quantized weights (docs/architecture.md#quantized-weights).

``QuantLinear`` keeps its weight as a ``QuantWeight`` (GGUF blocks or int8 rows) in buffers and computes
``x Wᵀ + b``:
- with ``triton`` (``linear_backend='triton'``, the default on CUDA) in the Triton GEMM on the blocks
  (``quant_triton``), activations in float32, float16 or bfloat16, any row count; on CPU it runs in
  Triton's interpreter (tests);
- after ``use_int8_activations`` (``activation_quantization='int8'``; CPUs with AVX-512 VNNI or AVX2) in
  ``quant_vnni.c`` on the weight repacked at load (``vnni_weight``), any row count, the activations rounded
  to int8 per 32 inputs;
- else with float32 activations: with the native kernels, up to ``QUANT_NATIVE_MAX_ROWS`` rows (decode
  steps of up to 64 sequences) in ``quant_gemm.c``, which dequantizes in registers;
- beyond (prefill chunks, bigger batches) by dequantizing slices of output rows into a float32 scratch
  buffer (C kernel) and multiplying each with torch's GEMM, whose AVX-512 blocking is ahead there
  (``bench/quant_kernels.py``: ×1.4 at 256 rows on 30 SmolLM2 layers, ×0.35 at 1 row);
- without the native kernels (or off the CPU) with PyTorch ops: the whole weight dequantized per call.

``SplitQuantLinear`` is a fused projection whose parts are stored in different formats, one
``QuantLinear`` each. ``QuantEmbedding`` looks rows up in the same format and dequantizes only those (torch
ops, on the table's device) into the model's dtype; a tied LM head is a ``QuantLinear`` over the
embedding's own buffers (one copy in memory).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.engine.model.quant_formats import QuantWeight, dequantize
from kvpilot.engine.native.ops import NativeOps
from kvpilot.engine.native.quant_ops import FORMATS
from kvpilot.engine.native.vnni_ops import VnniWeight

#: most rows ``quant_gemm.c`` takes; larger batches dequantize slices and use torch's GEMM (at parity at 64
#: rows on 30 SmolLM2 layers, bench/quant_kernels.py; the GEMM ahead beyond)
QUANT_NATIVE_MAX_ROWS = 64
#: floats of one dequantized slice of a large-batch product (8 MiB: a few slices of L2-sized work)
_SLICE_FLOATS = 1 << 21
_scratch = threading.local()


def _triton_gemm() -> Callable[..., torch.Tensor]:
    """``quant_triton.quant_linear``, imported at the first call: Triton reads ``TRITON_INTERPRET`` when
    the kernel module loads, which must not happen when this module is imported."""
    from kvpilot.engine.model import quant_triton

    return quant_triton.quant_linear


def _scratch_floats(count: int) -> torch.Tensor:
    """This thread's reusable float32 buffer of at least ``count`` elements (one per thread: the engine's
    model runs on one thread, and the buffer is only live inside one product)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < count:
        buf = _scratch.buf = torch.empty(count)
    return buf[:count]


class _QuantWeightBuffers(nn.Module):
    """The buffers of one ``QuantWeight``: ``qweight`` (uint8 rows) and ``scales`` (int8 only)."""

    qweight: torch.Tensor
    scales: torch.Tensor | None

    def __init__(self, weight: QuantWeight) -> None:
        super().__init__()
        self.format = weight.format.name
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.register_buffer("qweight", weight.data)
        self.register_buffer("scales", weight.scales)

    @property
    def weight_q(self) -> QuantWeight:
        if self.qweight.numel() == 0 and self.out_features:
            raise ValueError(
                f"the stored {self.format} blocks of this layer were released once repacked for int8 "
                "activations; only its int8-activation GEMM runs it"
            )
        return QuantWeight(FORMATS[self.format], self.qweight, self.scales, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


class QuantLinear(_QuantWeightBuffers):
    """``y = x Wᵀ + b`` on a quantized ``W``; ``bias`` (float32, loaded later) when ``has_bias``; ``triton``:
    the Triton GEMM computes it (else the native kernels, or PyTorch ops without them)."""

    bias: torch.Tensor | None

    def __init__(
        self, weight: QuantWeight, has_bias: bool, native: NativeOps | None, triton: bool = False
    ) -> None:
        super().__init__(weight)
        self.register_buffer("bias", torch.zeros(self.out_features) if has_bias else None)
        #: the native kernels this layer runs on; None on the Triton GEMM, so no C path takes it over
        self.native = None if triton else native
        self.triton = triton
        #: the weight repacked for the int8-activation GEMM (``use_int8_activations``), else None
        self.vnni_weight: VnniWeight | None = None

    def extra_repr(self) -> str:
        kernel = "triton" if self.triton else "cpu-int8-activations" if self.vnni_weight else "cpu"
        return f"{super().extra_repr()}, kernel={kernel}"

    def use_int8_activations(self) -> bool:
        """Run on the int8-activation GEMM from now on (repacking the weight once); False, changing
        nothing, where it cannot (a build without the int8 kernel, Triton, a format or width it has no
        layout for)."""
        native = self.native
        if native is None or not native.vnni.packable(self.format, self.in_features):
            return False
        self.vnni_weight = native.vnni.pack(self.qweight, self.scales, self.format, self.in_features)
        # a buffer too: counted in the weights' memory, and kept alive with the module
        self.register_buffer("vnni_packed", self.vnni_weight.packed, persistent=False)
        return True

    def release_stored_blocks(self) -> None:
        """Free the stored blocks once the packed tiles serve every product (a decoder projection: nothing
        else reads its blocks; not a tied head, whose blocks are the embedding's)."""
        if self.vnni_weight is None:
            raise RuntimeError("only a layer repacked for int8 activations can release its stored blocks")
        self.qweight = torch.empty(0, dtype=torch.uint8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton:
            flat = x.reshape(-1, self.in_features).contiguous()
            y = _triton_gemm()(flat, self.qweight, self.scales, self.format, self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        native = self.native
        if native is None or x.device.type != "cpu" or x.dtype != torch.float32:
            return F.linear(x, dequantize(self.weight_q, x.dtype), self.bias)
        if self.vnni_weight is not None:
            return native.vnni.linear(x, self.vnni_weight, self.bias)
        if x.shape[0] <= QUANT_NATIVE_MAX_ROWS:
            return native.quant.linear(x, self.qweight, self.scales, self.format, self.bias)
        return self._sliced(x, native)

    def _sliced(self, x: torch.Tensor, native: NativeOps) -> torch.Tensor:
        """Large batches: each slice of output rows dequantized into the scratch buffer, then one GEMM."""
        k, n = self.in_features, self.out_features
        step = max(16, _SLICE_FLOATS // k)
        out = torch.empty(x.shape[0], n)
        scratch = _scratch_floats(min(step, n) * k)
        for start in range(0, n, step):
            end = min(start + step, n)
            dense = scratch[: (end - start) * k].view(end - start, k)
            scales = None if self.scales is None else self.scales[start:end]
            native.quant.dequantize(self.qweight[start:end], scales, self.format, k, dense)
            torch.mm(x, dense.t(), out=out[:, start:end])
        return out if self.bias is None else out.add_(self.bias)


class SplitQuantLinear(nn.Module):
    """A fused projection (q/k/v, gate/up) whose parts are stored in different formats: one ``QuantLinear``
    per part, their outputs side by side; ``bias`` (float32, loaded later) spans all of them."""

    bias: torch.Tensor | None

    def __init__(
        self, parts: list[QuantWeight], has_bias: bool, native: NativeOps | None, triton: bool = False
    ) -> None:
        super().__init__()
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("the parts of a fused projection must share their inputs")
        self.parts = nn.ModuleList(QuantLinear(p, False, native, triton) for p in parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.register_buffer("bias", torch.zeros(self.out_features) if has_bias else None)

    @property
    def quant_parts(self) -> list[QuantLinear]:
        """``parts`` as what they are (an ``nn.ModuleList`` types its items as ``Module``)."""
        return cast("list[QuantLinear]", list(self.parts))

    @property
    def formats(self) -> list[str]:
        return [part.format for part in self.quant_parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([part(x) for part in self.parts], dim=-1)
        return out if self.bias is None else out.add_(self.bias.to(out.dtype))


class QuantEmbedding(_QuantWeightBuffers):
    """Token embedding rows from a quantized ``[vocab, hidden]`` table, in ``dtype`` (the model's);
    ``as_linear`` is its tied head."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(weight)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize(self.weight_q.rows(ids), self.dtype)

    def as_linear(self, native: NativeOps | None, triton: bool = False) -> QuantLinear:
        """An LM head over this table's buffers (no copy)."""
        return QuantLinear(self.weight_q, False, native, triton)
