"""Quantized weights on the PyTorch side: ``QuantWeight`` (the bytes the kernels read), block unpacking,
dequantization, int8 quantization and row concatenation (docs/architecture.md#quantized-weights).

Formats (``kvpilot.engine.native.quant_ops.FORMATS``): GGUF's ``Q4_0``, ``Q4_1`` and ``Q8_0`` as llama.cpp
stores them, rows of 32-weight blocks with an fp16 scale ``d`` first (and for ``Q4_1`` an fp16 minimum
``m``): weight ``j`` of a block is ``d * (q_j - 8)``, ``d * q_j + m`` and ``d * q_j`` (a signed byte); a Q4
block holds weight ``j < 16`` in the low nibble of byte ``j`` and weight ``j + 16`` in its high nibble.
``int8`` is symmetric per output row: ``w = scale[row] * q`` with ``q`` in [-127, 127]. llama.cpp's
K-quants ``Q4_K`` and ``Q6_K`` are rows of 256-weight super-blocks (layout: ``engine/native/quant_blocks.h``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpilot.engine.native.quant_ops import BLOCK, FORMATS, K_FORMATS, QuantFormat


@dataclass
class QuantWeight:
    """A ``[out_features, in_features]`` weight in ``format``: ``data`` uint8 ``[out_features, row_bytes]``,
    ``scales`` float32 ``[out_features]`` for int8 (else None)."""

    format: QuantFormat
    data: torch.Tensor
    scales: torch.Tensor | None
    in_features: int

    def __post_init__(self) -> None:
        expected = (self.data.shape[0], self.format.row_bytes(self.in_features))
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or tuple(self.data.shape) != expected:
            raise ValueError(
                f"{self.format.name} data must be uint8 {list(expected)}, got {tuple(self.data.shape)}"
            )
        if self.format.row_scales != (self.scales is not None):
            raise ValueError(
                f"{self.format.name} {'needs' if self.format.row_scales else 'takes no'} row scales"
            )

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def to(self, device: torch.device) -> QuantWeight:
        scales = None if self.scales is None else self.scales.to(device)
        return QuantWeight(self.format, self.data.to(device), scales, self.in_features)

    def rows(self, index: torch.Tensor) -> QuantWeight:
        """The weight rows ``index`` (an embedding lookup)."""
        scales = None if self.scales is None else self.scales[index]
        return QuantWeight(self.format, self.data[index], scales, self.in_features)


def unpack_blocks(weight: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, d, offset)`` with ``w[n, 32 b + j] = d[n, b] * q[n, b, j] + offset[n, b]``: ``q`` float32
    ``[N, blocks, 32]`` (Q4_0's already minus 8), ``d`` and ``offset`` ``[N, blocks]`` (offset: Q4_1's
    minimum, Q4_K's sub-block ``-dmin m``, else 0). An int8 row whose length is not a multiple
    of 32 is zero-padded to whole blocks. Q6_K has no such form (it scales every 16 weights):
    ``dequantize_k`` reads it."""
    fmt, data, n = weight.format, weight.data, weight.out_features
    if fmt.name == "Q4_K":
        q, d, dmin = _q4k_parts(weight)
        return q, d, -dmin
    if fmt.name in K_FORMATS:
        raise ValueError(f"{fmt.name} scales every 16 weights, not 32: dequantize it")
    if fmt.row_scales:
        assert weight.scales is not None, "a row-scaled format's weight has its scales (__post_init__)"
        blocks = -(-weight.in_features // BLOCK)
        q = torch.zeros(n, blocks * BLOCK, device=data.device)
        q[:, : weight.in_features] = data.view(torch.int8).float()
        d = weight.scales.float()[:, None].expand(n, blocks)
        return q.view(n, blocks, BLOCK), d, torch.zeros_like(d)
    raw = data.view(n, -1, fmt.block_bytes)

    d = _half(raw, 0).squeeze(-1)
    if fmt.name == "Q8_0":
        return raw[..., 2:].contiguous().view(torch.int8).float(), d, torch.zeros_like(d)
    nibbles = raw[..., 4:] if fmt.name == "Q4_1" else raw[..., 2:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()
    if fmt.name == "Q4_1":
        return q, d, _half(raw, 2).squeeze(-1)
    return q - 8.0, d, torch.zeros_like(d)  # Q4_0: d * (q - 8), as llama.cpp rounds it


def dequantize(weight: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[out_features, in_features]`` weight in ``dtype``, on the weight's device."""
    if weight.format.name in K_FORMATS:
        return dequantize_k(weight).to(dtype)
    q, d, offset = unpack_blocks(weight)
    w = q * d[..., None] + offset[..., None] if weight.format.name == "Q4_1" else q * d[..., None]
    return w.reshape(weight.out_features, -1)[:, : weight.in_features].to(dtype)


def _half(raw: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at bytes ``start, start + 1`` of each block of ``raw`` [..., block_bytes], as float32."""
    return raw[..., start : start + 2].contiguous().view(torch.float16).float()


def dequantize_k(weight: QuantWeight) -> torch.Tensor:
    """A Q4_K / Q6_K weight in float32 with torch ops on its own device, in gguf-py's order of float
    operations (so equal to ``gguf.quants.dequantize`` bit for bit; layout: ``quant_blocks.h``)."""
    n, name = weight.out_features, weight.format.name
    raw = weight.data.view(n, -1, weight.format.block_bytes)  # [N, super-blocks, bytes]
    if name == "Q4_K":
        q, d, dm = _q4k_parts(weight)
        return (d[..., None] * q - dm[..., None]).reshape(n, -1)
    if name != "Q6_K":
        raise ValueError(f"{name} is not a K-quant")
    ql = raw[..., :128].reshape(n, -1, 2, 1, 64).int()  # [N, S, half, nibble, 64]
    ql = ((ql >> torch.tensor([0, 4], device=ql.device).view(2, 1)) & 0xF).reshape(n, -1, 2, 4, 32)
    qh = raw[..., 128:192].reshape(n, -1, 2, 1, 32).int()
    qh = (qh >> torch.tensor([0, 2, 4, 6], device=qh.device).view(4, 1)) & 3  # [N, S, half, group, 32]
    q = ((ql | (qh << 4)) - 32).reshape(n, -1, 16, 16).float()  # 16 groups of 16 weights, one scale each
    d = _half(raw, 208) * raw[..., 192:208].contiguous().view(torch.int8).float()  # [N, S, 16]
    return (d[..., None] * q).reshape(n, -1)


def _q4k_parts(weight: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_K weight's nibbles ``q`` float32 [N, sub-blocks, 32] and per sub-block ``d sc`` and ``dmin m``
    [N, sub-blocks]: ``w = d sc q - dmin m``."""
    n = weight.out_features
    raw = weight.data.view(n, -1, weight.format.block_bytes)  # [N, super-blocks, bytes]
    s = raw[..., 4:16].int()
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 2) & 0x30)], dim=-1)
    m = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 2) & 0x30)], dim=-1)
    d, dm = _half(raw, 0) * sc.float(), _half(raw, 2) * m.float()  # [N, S, 8]: one per sub-block
    qs = raw[..., 16:144].reshape(n, -1, 4, 1, 32).int()  # sub-block 2p: low nibbles, 2p + 1: high
    q = ((qs >> torch.tensor([0, 4], device=qs.device).view(2, 1)) & 0xF).reshape(n, -1, 32).float()
    return q, d.reshape(n, -1), dm.reshape(n, -1)


def quantize_int8(weight: torch.Tensor) -> QuantWeight:
    """Symmetric per-output-row int8 of a float ``[out, in]`` weight: ``scale = max |w_row| / 127``
    (an all-zero row gets scale 1 and zeros), ``q = round(w / scale)``."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantWeight(FORMATS["int8"], q.view(torch.uint8).contiguous(), scales.contiguous(), w.shape[1])


def concat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """One weight whose rows are ``parts``' rows in order (a fused q/k/v or gate/up projection)."""
    first = parts[0]
    for part in parts[1:]:
        if part.format != first.format or part.in_features != first.in_features:
            raise ValueError(
                f"cannot fuse {part.format.name} x {part.in_features} rows with {first.format.name} x "
                f"{first.in_features} rows"
            )
    # one format: every part has row scales or none does (``QuantWeight.__post_init__``)
    scales = None if first.scales is None else torch.cat([p.scales for p in parts if p.scales is not None])
    return QuantWeight(
        first.format, torch.cat([p.data for p in parts]).contiguous(), scales, first.in_features
    )
