"""The layout of one forward step's flattened batch, as every attention backend sees it.

Batch order: the ``num_decodes`` sequences with exactly one new token come first, then the
prefill/extend sequences (several new tokens each, attending to their cached paged prefix plus a
causal triangle over the new tokens). Token ``t`` of the flat batch belongs to sequence ``b`` when
``query_start_loc[b] <= t < query_start_loc[b + 1]``.

KV cache layout (per layer): ``key_cache`` and ``value_cache`` are ``[num_blocks, block_size,
num_kv_heads, head_dim]`` ("NHD", the default, which the Triton kernels read) or, for a backend that
declares ``kv_cache_layout = "HND"``, ``[num_blocks, num_kv_heads, block_size, head_dim]``. Block 0 is
reserved and pads block tables. A token at absolute position ``p`` of sequence ``b`` lives in slot
``block_tables[b, p // block_size] * block_size + p % block_size`` (block = slot // block_size, offset
= slot % block_size, whatever the layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Per-step batch layout shared by all layers of one forward pass."""

    #: int64 [num_tokens]: the cache slot each new token's K/V is written to
    slot_mapping: torch.Tensor
    #: int32 [num_seqs + 1]: offsets of each sequence's new tokens in the flat batch
    query_start_loc: torch.Tensor
    #: int32 [num_seqs]: context length after this step (cached prefix + new tokens)
    seq_lens: torch.Tensor
    #: int32 [num_seqs, max_blocks_per_seq]: physical block ids, padded with 0
    block_tables: torch.Tensor
    #: the leading sequences that each have exactly one new token
    num_decodes: int
    #: host copies, so a backend can loop or size launches without a device sync
    query_lens_host: list[int]
    seq_lens_host: list[int]
    block_size: int
    #: the step's launches are recorded into a CUDA graph and replayed for other sequences
    #: (``engine/decode_graphs.py``): a backend must size them for any context lengths, not from the host
    #: lists above, which hold the capture's placeholder rows
    captured: bool = False
    #: backend-private tensors computed once per step in ``AttentionBackend.prepare``
    extras: dict[str, object] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)

    @property
    def context_lens_host(self) -> list[int]:
        """Tokens already cached before this step, per sequence."""
        return [s - q for s, q in zip(self.seq_lens_host, self.query_lens_host, strict=True)]
