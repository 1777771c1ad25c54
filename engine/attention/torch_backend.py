"""PyTorch paged attention (the CPU path): gather each sequence's K/V through its block table, then SDPA.

Decode sequences are batched into one SDPA call. Their GQA groups are folded into the query-length axis
(``[B, kv_heads, group, D]`` queries against ``[B, kv_heads, L, D]`` keys), so K/V are read once per KV
head and never expanded. Prefill/extend sequences run one SDPA each: a causal triangle over the new tokens
offset by the cached prefix. Index arithmetic is done once per step in ``prepare`` and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpilot.engine.attention.backend import AttentionBackend
from kvpilot.engine.attention.metadata import AttentionMetadata


@dataclass
class _PrefillPlan:
    token_start: int
    token_end: int
    #: int64 [seq_len] cache slots of the whole context, or None when the context is only new tokens
    context_slots: torch.Tensor | None
    #: bool [q_len, seq_len] (True = attend), or None for a plain causal triangle from position 0
    mask: torch.Tensor | None


def _slots_for(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions ``0..length-1`` for every row of ``block_table`` [B, max_blocks]."""
    pos = torch.arange(length, device=block_table.device)
    blocks = block_table[:, pos // block_size].long()
    return blocks * block_size + (pos % block_size)


def _window_mask(q_pos: torch.Tensor, k_len: int, window: int | None) -> torch.Tensor:
    """bool [len(q_pos), k_len]: causal (key <= query) and, with a window, query - key < window."""
    k_pos = torch.arange(k_len, device=q_pos.device)
    diff = q_pos.unsqueeze(1) - k_pos.unsqueeze(0)
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    return mask


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        bs, nd = meta.block_size, meta.num_decodes
        if nd:
            lens = meta.seq_lens[:nd].long()
            max_len = max(meta.seq_lens_host[:nd])
            slots = _slots_for(meta.block_tables[:nd], max_len, bs)
            pos = torch.arange(max_len, device=lens.device)
            valid = pos.unsqueeze(0) < lens.unsqueeze(1)
            if self.sliding_window is not None:
                valid &= pos.unsqueeze(0) >= (lens - self.sliding_window).unsqueeze(1)
            meta.extras["decode_slots"] = slots
            meta.extras["decode_mask"] = valid[:, None, None, :]  # [B, 1, 1, L] broadcast over heads/group
        plans: list[_PrefillPlan] = []
        starts = meta.query_start_loc.tolist() if meta.num_seqs > nd else []
        for b in range(nd, meta.num_seqs):
            q_len, seq_len = meta.query_lens_host[b], meta.seq_lens_host[b]
            ctx = seq_len - q_len
            if ctx == 0 and self.sliding_window is None:
                plans.append(_PrefillPlan(starts[b], starts[b + 1], None, None))
                continue
            q_pos = torch.arange(ctx, seq_len, device=meta.block_tables.device)
            mask = _window_mask(q_pos, seq_len, self.sliding_window)
            slots = _slots_for(meta.block_tables[b:b + 1], seq_len, bs)[0] if ctx else None
            plans.append(_PrefillPlan(starts[b], starts[b + 1], slots, mask))
        meta.extras["prefill_plans"] = plans

    def write_kv(self, key, value, key_cache, value_cache, meta) -> None:
        kv_heads, head_dim = key.shape[1], key.shape[2]
        key_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key.to(key_cache.dtype))
        value_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value.to(value_cache.dtype))

    def attend(self, query, key, value, key_cache, value_cache, meta) -> torch.Tensor:
        out = torch.empty_like(query)
        kvh, d, group = self.num_kv_heads, self.head_dim, self.num_heads // self.num_kv_heads
        flat_k = key_cache.view(-1, kvh, d)
        flat_v = value_cache.view(-1, kvh, d)
        nd = meta.num_decodes
        if nd:
            slots = meta.extras["decode_slots"]
            k = flat_k[slots].transpose(1, 2).to(query.dtype)  # [B, kvh, L, D]
            v = flat_v[slots].transpose(1, 2).to(query.dtype)
            q = query[:nd].view(nd, kvh, group, d)  # GQA group folded into the query-length axis
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.extras["decode_mask"], scale=self.scale)
            out[:nd] = o.reshape(nd, self.num_heads, d)
        for plan in meta.extras["prefill_plans"]:
            s, e = plan.token_start, plan.token_end
            q = query[s:e].transpose(0, 1)  # [Hq, n, D]
            if plan.context_slots is None:
                k, v = key[s:e].transpose(0, 1), value[s:e].transpose(0, 1)
            else:
                k = flat_k[plan.context_slots].transpose(0, 1).to(query.dtype)
                v = flat_v[plan.context_slots].transpose(0, 1).to(query.dtype)
            if plan.mask is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=group > 1)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, scale=self.scale,
                                                   enable_gqa=group > 1)
            out[s:e] = o.transpose(0, 1)
        return out
