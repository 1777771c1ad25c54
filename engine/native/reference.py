"""The PyTorch references of the C kernels (``ops.NativeOps``): what each kernel must compute, written
plainly; tests hold every kernel to its reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpilot.engine.kv.kv_quant import KVQuant, dequantize_caches, quantize_rows
from kvpilot.engine.model.quant_formats import QuantWeight, dequantize, unpack_blocks
from kvpilot.engine.native.quant_ops import K_FORMATS


def reference_add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    if delta is not None:
        residual += delta
    return weight * (residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + eps))


def reference_rope_(
    x: torch.Tensor,
    num_heads: int,
    head_dim: int,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Rotate-half RoPE over each head's first ``cos.shape[1]`` dims (partial rotary: the rest pass)."""
    rotary = cos.shape[1]
    heads = x[:, : num_heads * head_dim].view(x.shape[0], num_heads, head_dim)[..., :rotary]
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    half = rotary // 2
    rotated = torch.cat((-heads[..., half:], heads[..., :half]), dim=-1)
    heads.copy_(heads * c + rotated * s)


def reference_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    quant: KVQuant | None = None,
) -> None:
    """Token ``t``'s heads into slot ``slots[t]`` of the HND caches: values, or ``quant``'s codes (and int8
    scales) of them."""
    _, kv_heads, block_size, head_dim = key_cache.shape
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        blk, off = slot // block_size, slot % block_size
        for x, cache, is_key in ((key, key_cache, True), (value, value_cache, False)):
            rows = x[t].view(kv_heads, head_dim)
            if quant is None:
                cache[blk, :, off] = rows
                continue
            codes, scales = quantize_rows(rows, quant, is_key)
            cache[blk, :, off] = codes
            if scales is not None:
                row_scales = quant.key_scales if is_key else quant.value_scales
                assert row_scales is not None
                row_scales[blk, :, off] = scales


def reference_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def reference_gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def reference_paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
    quant: KVQuant | None = None,
) -> torch.Tensor:
    """Decode attention over the HND caches' values (``quant``: their codes, dequantized first)."""
    key_cache, value_cache = dequantize_caches(key_cache, value_cache, quant)
    _, kv_heads, block_size, head_dim = key_cache.shape
    num_heads = query.shape[1] // head_dim
    out = torch.empty(query.shape[0], num_heads, head_dim)
    for b in range(query.shape[0]):
        length = int(seq_lens[b])
        start = max(0, length - sliding_window) if sliding_window else 0
        positions = torch.arange(start, length)
        blocks = block_tables[b, positions // block_size].long()
        keys = key_cache[blocks, :, positions % block_size]  # [L, Hkv, D]
        values = value_cache[blocks, :, positions % block_size]
        q = query[b].view(num_heads, head_dim)
        group = num_heads // kv_heads
        k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
        v = values.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (k @ q.unsqueeze(-1)).squeeze(-1) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        weights = torch.softmax(scores, dim=-1)
        out[b] = (weights.unsqueeze(1) @ v).squeeze(1)
    return out


def reference_paged_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
    quant: KVQuant | None = None,
) -> torch.Tensor:
    """Each new token as its own query of ``reference_paged_decode`` over the positions up to its own."""
    starts = query_start_loc.tolist()
    rows: list[int] = []
    tables: list[torch.Tensor] = []
    lens: list[int] = []
    for s, length in enumerate(seq_lens.tolist()):
        count = starts[s + 1] - starts[s]
        rows += range(starts[s], starts[s + 1])
        tables += [block_tables[s]] * count
        lens += range(length - count + 1, length + 1)
    if not rows:
        return torch.empty(0, query.shape[1] // key_cache.shape[-1], key_cache.shape[-1])
    return reference_paged_decode(
        query[rows],
        key_cache,
        value_cache,
        torch.stack(tables),
        torch.tensor(lens, dtype=torch.int32),
        scale,
        sliding_window,
        softcap,
        quant,
    )


def reference_quant_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``quant_gemm.c``'s math, block by block: each 32-input block contributes
    ``d * (q . x_block) + offset * sum(x_block)``, summed over blocks (tests also hold this to
    dequantize-then-matmul). K-quants: dequantize-then-matmul in float64."""
    if weight.format.name in K_FORMATS:
        y = (x.double() @ dequantize(weight).double().T).float()
        return y if bias is None else y + bias
    q, d, offset = unpack_blocks(weight)  # [N, B, 32], [N, B], [N, B]
    blocks = q.shape[1]
    xb = F.pad(x.float(), (0, blocks * q.shape[2] - x.shape[1])).view(x.shape[0], blocks, q.shape[2])
    per_block = torch.einsum("mbj,nbj->mnb", xb, q)
    y = (per_block * d).sum(-1) + xb.sum(-1) @ offset.T
    return y if bias is None else y + bias


def reference_vnni_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quant_vnni.c``'s rounding of float32 ``x`` [M, K]: per 32-input block ``q = round(x * (127 /
    amax))`` (half to even) as int8, ``dx = amax / 127`` and ``sx = dx * sum(q)`` [M, K / 32]."""
    m, k = x.shape
    xb = x.float().reshape(m, k // 32, 32)
    amax = xb.abs().amax(-1)
    # a true division (a Python number divided by a tensor is a reciprocal times the number in torch)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None])
    dx = amax / 127.0
    return q.to(torch.int8).reshape(m, k), dx, dx * q.sum(-1)


def reference_vnni_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``quant_vnni.c``'s product in float64: the activations rounded (``reference_vnni_quantize``) times
    the weights with their per-block scale and offset rounded to fp16, as the packed tiles hold them."""
    q, d, offset = unpack_blocks(weight)  # w = d q + offset
    w = q.double() * d.half().double()[..., None] + offset.half().double()[..., None]
    codes, dx, _ = reference_vnni_quantize(x)
    xq = codes.double().view(x.shape[0], -1, 32) * dx.double()[..., None]
    y = (xq.reshape(x.shape[0], -1) @ w.reshape(w.shape[0], -1).T).float()
    return y if bias is None else y + bias
