"""Plain PyTorch references for the Triton kernels: per-token and per-sequence loops, fp32 math.

Written for obviousness, not speed; the kernel tests compare against these.
"""

from __future__ import annotations

import torch

from kvpilot.engine.kv.kv_quant import KVQuant, quantize_rows


def reference_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    quant: KVQuant | None = None,
) -> None:
    """Copy token ``t``'s K/V into row ``slot % block_size`` of block ``slot // block_size`` (as ``quant``'s
    codes and int8 row scales when given); negative slots are padding and skipped."""
    block_size = key_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        at = (slot // block_size, slot % block_size)
        if quant is None:
            key_cache[at] = key[token].to(key_cache.dtype)
            value_cache[at] = value[token].to(value_cache.dtype)
            continue
        for x, cache, scales, is_key in (
            (key, key_cache, quant.key_scales, True),
            (value, value_cache, quant.value_scales, False),
        ):
            codes, row_scales = quantize_rows(x[token], quant, is_key)
            cache[at] = codes
            if scales is not None and row_scales is not None:
                scales[at] = row_scales


def gather_sequence_kv(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The ``[seq_len, num_kv_heads, head_dim]`` K or V rows of one sequence, in position order."""
    block_size = cache.shape[1]
    rows = [cache[int(block_table_row[pos // block_size]), pos % block_size] for pos in range(seq_len)]
    return torch.stack(rows)


def attend_one_sequence(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Softmax attention of the ``query`` ``[q_len, num_heads, head_dim]`` tokens at the last ``q_len``
    positions of a ``seq_len``-key sequence: causal, optionally windowed and soft-capped (scores
    ``cap * tanh(s / cap)``), GQA by repeating KV heads."""
    q_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
    key_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
    visible = key_pos <= query_pos
    if sliding_window is not None:
        visible &= key_pos > query_pos - sliding_window
    out = torch.empty(q_len, num_heads, query.shape[2], dtype=torch.float32, device=query.device)
    for head in range(num_heads):
        kv_head = head // group
        scores = (query[:, head].float() @ keys[:, kv_head].float().T) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[:, head] = torch.softmax(scores, dim=-1) @ values[:, kv_head].float()
    return out


def reference_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Output ``[num_tokens, num_heads, head_dim]`` (fp32) of every sequence's new tokens attending
    their paged context; decode is the case ``q_len == 1``."""
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    starts = query_start_loc.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        keys = gather_sequence_kv(key_cache, block_tables[seq], seq_len)
        values = gather_sequence_kv(value_cache, block_tables[seq], seq_len)
        begin, end = starts[seq], starts[seq + 1]
        out[begin:end] = attend_one_sequence(query[begin:end], keys, values, scale, sliding_window, softcap)
    return out


def reference_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Reference for ``decode.paged_decode``: query token ``b`` is sequence ``b``'s only new token."""
    query_start_loc = torch.arange(query.shape[0] + 1)
    return reference_paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window, softcap
    )


def reference_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Reference for ``prefill.paged_prefill`` (``query_start_loc`` starting at 0)."""
    return reference_paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window, softcap
    )
