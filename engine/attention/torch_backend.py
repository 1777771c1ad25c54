"""PyTorch paged attention (the CPU path): gather each sequence's K/V blocks, then SDPA.

The cache is head-major inside a block (``[num_blocks, kv_heads, block_size, head_dim]``, layout "HND"),
so one ``index_select`` over (block, kv_head) rows yields K/V already in SDPA's ``[B, kv_heads, L, D]``
layout — no transposed copies. Decode sequences are batched, bucketed by length so short contexts are not
padded to the longest, and their GQA groups are folded into the query-length axis (``[B, kv_heads, group,
D]`` queries), so K/V are never expanded per query head. Prefill/extend sequences run one SDPA each over
their cached prefix plus a causal triangle on the new tokens. All index arithmetic happens once per step
in ``prepare`` and is shared by every layer.

With ``native`` set (float32 on CPU, ``kvpilot.engine.native``), no K/V is gathered and SDPA is not used:
the K/V write is a C scatter, decodes run one C kernel that reads each sequence's K/V blocks in place with
an online softmax, and prefill/extend tokens another that does the same for tiles of 24 query rows (tokens x
the query heads of one KV head) with register-blocked score and value products (flash-attention style).
Against SDPA per sequence (`bench/native_kernels.py`, 30 SmolLM2 layers): x1.8 on 14 new 146-token prompts,
x1.5 on 8 of 256, parity for 32 tokens after a 1024-token cached prefix. A CPU without AVX2, or a head size
that is not a multiple of 16, keeps SDPA for prefill.

Per-layer attention (``LayerAttention``): the masks depend on the layer's window, so they are built on the
first layer of a step that uses that window and shared by the others (Gemma: two masks per step). SDPA has
no soft-capping; a soft-capped layer without the C kernels runs the same math unfused (scores, cap, mask,
softmax).

A quantized cache (docs/architecture.md#kv-cache-dtype) is written as codes (``kv_quant``'s quantizers, or
the C scatter) and its gathers are dequantized to the query's dtype before SDPA; the C kernels dequantize
each K/V row as they read it. Every query then reads its sequence's K/V from the cache, its own step's
tokens included, as the C and Triton kernels do, so all backends attend the same rounded keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpilot.engine.attention.backend import AttentionBackend, LayerAttention
from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.engine.attention.torch_plans import (
    DecodeBucket,
    PrefillPlan,
    StepPlan,
    length_buckets,
    step_plan,
    window_mask,
)
from kvpilot.engine.kv.kv_quant import KVQuant, as_bytes, dequantize, quantize_rows
from kvpilot.engine.native.ops import NativeOps
from kvpilot.engine.native.paged_attention_ops import PREFILL_HEAD_DIM_MULTIPLE


def _softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, layer: LayerAttention
) -> torch.Tensor:
    """SDPA's math with Gemma 2's soft-capping, for ``q`` [..., Hq, n, D] over ``k``/``v`` [..., Hkv, L, D]
    (GQA by repeating KV heads) and a bool ``mask`` [n, L] or broadcastable (None = causal from 0)."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = (q.float() @ k.float().transpose(-1, -2)) * layer.scale
    cap = float(layer.logit_softcap or 0.0)
    scores = cap * torch.tanh(scores / cap)
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    kv_cache_layout = "HND"
    #: fused C kernels for float32 decode attention and K/V writes; None = PyTorch ops
    native: NativeOps | None = None

    def _gather_rows(self, block_table: torch.Tensor) -> torch.Tensor:
        """Rows of the cache viewed as ``[num_blocks * kv_heads, block_size, D]`` for ``block_table``
        [B, nb], ordered [B, kv_heads, nb] so the gather lands in SDPA layout."""
        heads = torch.arange(self.num_kv_heads, device=block_table.device).view(1, -1, 1)
        return (block_table.long().unsqueeze(1) * self.num_kv_heads + heads).reshape(-1)

    def prepare(self, meta: AttentionMetadata) -> None:
        bs, nd = meta.block_size, meta.num_decodes
        buckets: list[DecodeBucket] = []
        if nd and self.native is None:
            lens_host = meta.seq_lens_host[:nd]
            for idx in length_buckets(lens_host):
                rows = torch.tensor(idx, device=meta.block_tables.device)
                num_blocks = -(-max(lens_host[i] for i in idx) // bs)
                table = meta.block_tables.index_select(0, rows)[:, :num_blocks]
                lens = meta.seq_lens.index_select(0, rows).long()
                buckets.append(DecodeBucket(rows, self._gather_rows(table), num_blocks, lens, {}))
        meta.extras["torch_step_plan"] = StepPlan(
            buckets, self._native_prefill(), meta.slot_mapping // bs, meta.slot_mapping % bs
        )

    def _prefill_plans(
        self, meta: AttentionMetadata, window: int | None, from_cache: bool
    ) -> list[PrefillPlan]:
        """One SDPA plan per prefill/extend sequence: its token range, the gather of its cached context, the
        mask when the causal triangle alone does not say what each query sees. ``from_cache``: read the new
        tokens' K/V from the (quantized) cache too."""
        step = step_plan(meta)
        if step.native_prefill:
            return []
        cached = step.prefill_plans
        if (window, from_cache) in cached:
            return cached[window, from_cache]
        bs, nd = meta.block_size, meta.num_decodes
        plans: list[PrefillPlan] = []
        starts = meta.query_start_loc.tolist() if meta.num_seqs > nd else []
        for b in range(nd, meta.num_seqs):
            q_len, seq_len = meta.query_lens_host[b], meta.seq_lens_host[b]
            ctx = seq_len - q_len
            if ctx == 0 and window is None and not from_cache:
                plans.append(PrefillPlan(starts[b], starts[b + 1], None, 0, None))
                continue
            num_blocks = -(-seq_len // bs)
            q_pos = torch.arange(ctx, seq_len, device=meta.block_tables.device)
            if ctx or from_cache:
                mask = window_mask(q_pos, num_blocks * bs, window)
                rows = self._gather_rows(meta.block_tables[b : b + 1, :num_blocks])
            else:  # sliding window over new tokens only
                mask, rows = window_mask(q_pos, seq_len, window), None
            plans.append(PrefillPlan(starts[b], starts[b + 1], rows, num_blocks, mask))
        cached[window, from_cache] = plans
        return plans

    def _native_prefill(self) -> bool:
        """Whether prefill/extend tokens go to the native kernel (else SDPA per sequence)."""
        return (
            self.native is not None
            and self.native.attention.has_prefill
            and self.head_dim % PREFILL_HEAD_DIM_MULTIPLE == 0
        )

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        quant: KVQuant | None = None,
    ) -> None:
        native_cache = quant is not None or key_cache.dtype == torch.float32
        if self.native is not None and key.dtype == torch.float32 and native_cache:
            tokens = key.shape[0]
            self.native.write_kv(
                key.reshape(tokens, -1),
                value.reshape(tokens, -1),
                key_cache,
                value_cache,
                meta.slot_mapping,
                quant,
            )
            return
        step = step_plan(meta)
        blk, off = step.write_block, step.write_offset
        # HND cache: [blocks, heads, bs, D]; advanced indices on dims 0 and 2 put tokens first
        if quant is None:
            key_cache[blk, :, off] = key.to(key_cache.dtype)
            value_cache[blk, :, off] = value.to(value_cache.dtype)
            return
        for x, cache, scales, is_key in (
            (key, key_cache, quant.key_scales, True),
            (value, value_cache, quant.value_scales, False),
        ):
            codes, row_scales = quantize_rows(x, quant, is_key)
            as_bytes(cache)[blk, :, off] = as_bytes(codes)  # fp8 indexing is not implemented everywhere
            if scales is not None and row_scales is not None:
                scales[blk, :, off] = row_scales

    def _gather(self, cache: torch.Tensor, rows: torch.Tensor, batch: int, num_blocks: int) -> torch.Tensor:
        _, kvh, bs, d = cache.shape
        flat = cache.view(-1, bs, d)
        return flat.index_select(0, rows).view(batch, kvh, num_blocks * bs, d)

    def _gather_kv(
        self,
        caches: tuple[torch.Tensor, torch.Tensor],
        quant: KVQuant | None,
        rows: torch.Tensor,
        batch: int,
        num_blocks: int,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[batch, kv_heads, num_blocks * block_size, D]`` of the gathered rows, in ``dtype``."""
        if quant is None:
            k, v = (self._gather(c, rows, batch, num_blocks) for c in caches)
            return k.to(dtype), v.to(dtype)
        k, v = (self._gather(as_bytes(c), rows, batch, num_blocks).view(c.dtype) for c in caches)
        out = []
        for codes, tensor_scale, scales in (
            (k, quant.k_scale, quant.key_scales),
            (v, quant.v_scale, quant.value_scales),
        ):
            row_scales = None
            if scales is not None:  # per-row scales, gathered like the codes
                _, kvh, bs = scales.shape
                row_scales = scales.view(-1, bs).index_select(0, rows).view(batch, kvh, num_blocks * bs)
            out.append(dequantize(codes, tensor_scale, row_scales).to(dtype))
        return out[0], out[1]

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        layer: LayerAttention | None = None,
        quant: KVQuant | None = None,
    ) -> torch.Tensor:
        layer = layer or self.default_layer
        window, scale = layer.sliding_window, layer.scale
        out = torch.empty_like(query)
        kvh, d, group = self.num_kv_heads, self.head_dim, self.num_heads // self.num_kv_heads
        if self.native is not None and meta.num_decodes:
            nd = meta.num_decodes
            out[:nd] = self.native.attention.paged_decode(
                query[:nd].reshape(nd, -1),
                key_cache,
                value_cache,
                meta.block_tables,
                meta.seq_lens,
                scale,
                window,
                layer.logit_softcap,
                quant,
            )
        caches = (key_cache, value_cache)
        step = step_plan(meta)
        for bucket in step.decode_buckets:
            n = bucket.rows.numel()
            k, v = self._gather_kv(caches, quant, bucket.gather_rows, n, bucket.num_blocks, query.dtype)
            q = query.index_select(0, bucket.rows).view(n, kvh, group, d)  # GQA group as query length
            mask = bucket.mask(window, meta.block_size)
            if layer.logit_softcap is None:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            else:  # the GQA group is the query axis here: one KV head per group of rows
                o = _softcapped_attention(
                    q.unsqueeze(-3), k.unsqueeze(-3), v.unsqueeze(-3), mask[:, :, None], layer
                )
            out.index_copy_(0, bucket.rows, o.reshape(n, self.num_heads, d))
        if self.native is not None and step.native_prefill and meta.num_seqs > meta.num_decodes:
            nd = meta.num_decodes
            out[nd:] = self.native.attention.paged_prefill(
                query.reshape(query.shape[0], -1),
                key_cache,
                value_cache,
                meta.block_tables[nd:],
                meta.query_start_loc[nd:],
                meta.seq_lens[nd:],
                scale,
                window,
                layer.logit_softcap,
                quant,
            )
        for plan in self._prefill_plans(meta, window, quant is not None):
            s, e = plan.token_start, plan.token_end
            q = query[s:e].transpose(0, 1)  # [Hq, n, D]
            if plan.gather_rows is None:
                k, v = key[s:e].transpose(0, 1), value[s:e].transpose(0, 1)
            else:
                k, v = self._gather_kv(caches, quant, plan.gather_rows, 1, plan.num_blocks, query.dtype)
                k, v = k[0], v[0]
            # 4-D inputs: SDPA only dispatches to its fused CPU kernel with a batch dimension. GQA without
            # expanding K/V: with torch 2.13 ``enable_gqa`` stays on the fused kernel and measured faster
            # than repeat_interleave (140 new tokens: 825 vs 969 us; 32 after a 500-token prefix: 694 vs
            # 1339 us; identical outputs); older torch fell back to the unfused math path here.
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
            gqa = group > 1
            if layer.logit_softcap is not None:
                o = _softcapped_attention(q, k, v, plan.mask, layer)[0]
            elif plan.mask is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)[0]
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, scale=scale, enable_gqa=gqa)[
                    0
                ]
            out[s:e] = o.transpose(0, 1)
        return out
