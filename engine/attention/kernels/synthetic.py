"""Random paged batches for the kernel tests and benchmarks.

Blocks are handed out in a shuffled order (block 0 stays reserved and pads the block tables), so a
kernel that assumes contiguous or in-order blocks fails. Every cache slot that holds no token of any
sequence is NaN: a kernel that reads past a sequence's end, or a padded table entry, and lets it reach
the output turns the result NaN instead of passing by luck.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpilot.engine.attention.metadata import AttentionMetadata


@dataclass
class PagedBatch:
    """A step's sequences: ``context_lens[b]`` cached tokens plus ``query_lens[b]`` new ones, all of whose
    K/V are already in the cache."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks], padded with 0
    seq_lens: torch.Tensor  # int32 [num_seqs]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    slot_mapping: torch.Tensor  # int64 [num_tokens]: the new tokens' slots
    context_lens: list[int]
    query_lens: list[int]

    @property
    def block_size(self) -> int:
        return self.key_cache.shape[1]

    def metadata(self, num_decodes: int) -> AttentionMetadata:
        """The step as an engine would describe it (the first ``num_decodes`` sequences have one token)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping,
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            num_decodes=num_decodes,
            query_lens_host=list(self.query_lens),
            seq_lens_host=[c + q for c, q in zip(self.context_lens, self.query_lens, strict=True)],
            block_size=self.block_size,
        )


def make_paged_batch(
    context_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedBatch:
    """Random queries and a random paged cache holding every sequence's ``context + query`` tokens."""
    if len(context_lens) != len(query_lens) or not query_lens:
        raise ValueError("context_lens and query_lens must be non-empty and of equal length")
    if any(q < 1 for q in query_lens) or any(c < 0 for c in context_lens):
        raise ValueError("every sequence needs >= 1 new token and a non-negative context")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks
    shuffled = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()

    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    next_block = 0
    for seq, count in enumerate(blocks_per_seq):
        block_tables[seq, :count] = torch.tensor(shuffled[next_block : next_block + count])
        next_block += count

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    value_cache = torch.full_like(key_cache, float("nan"))
    flat_keys = key_cache.view(-1, num_kv_heads, head_dim)
    flat_values = value_cache.view(-1, num_kv_heads, head_dim)
    new_slots = []
    for seq, seq_len in enumerate(seq_lens):
        positions = torch.arange(seq_len)
        slots = block_tables[seq, positions // block_size].long() * block_size + positions % block_size
        flat_keys[slots] = randn(seq_len, num_kv_heads, head_dim)
        flat_values[slots] = randn(seq_len, num_kv_heads, head_dim)
        new_slots.append(slots[context_lens[seq] :])

    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    return PagedBatch(
        query=randn(sum(query_lens), num_heads, head_dim).to(device),
        key_cache=key_cache.to(device),
        value_cache=value_cache.to(device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=starts.to(device),
        slot_mapping=torch.cat(new_slots).to(device),
        context_lens=list(context_lens),
        query_lens=list(query_lens),
    )
