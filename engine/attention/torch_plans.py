"""The torch backend's per-step plan: what ``TorchAttentionBackend.prepare`` works out once per step and
every layer reads (decode length buckets with their gathers and masks, prefill plans, write positions)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch

from kvpilot.engine.attention.metadata import AttentionMetadata

#: start a new decode bucket when a context is this much longer than the bucket's shortest one
_BUCKET_GROWTH = 1.5
_MAX_BUCKETS = 4


@dataclass
class DecodeBucket:
    #: flat-batch rows (== sequence indices, decodes come first) of this bucket's sequences
    rows: torch.Tensor
    #: int64 [B * kv_heads * blocks] rows of the (block, kv_head)-flattened cache to gather
    gather_rows: torch.Tensor
    num_blocks: int
    #: int64 [B] the sequences' lengths
    lens: torch.Tensor
    #: per window: bool [B, 1, 1, L] keys each query may attend (within its length and window)
    masks: dict[int | None, torch.Tensor]

    def mask(self, window: int | None, block_size: int) -> torch.Tensor:
        if window not in self.masks:
            pos = torch.arange(self.num_blocks * block_size, device=self.lens.device)
            valid = pos.unsqueeze(0) < self.lens.unsqueeze(1)
            if window is not None:
                valid &= pos.unsqueeze(0) >= (self.lens - window).unsqueeze(1)
            self.masks[window] = valid[:, None, None, :]
        return self.masks[window]


@dataclass
class PrefillPlan:
    token_start: int
    token_end: int
    #: gather rows of the whole context's blocks, or None when the context is only the new tokens
    gather_rows: torch.Tensor | None
    num_blocks: int
    #: bool [q_len, L] (True = attend), or None for a plain causal triangle from position 0
    mask: torch.Tensor | None


@dataclass
class StepPlan:
    """What ``prepare`` works out once per step for every layer (kept in ``meta.extras``)."""

    decode_buckets: list[DecodeBucket]
    #: the native C kernels compute the prefill rows' attention
    native_prefill: bool
    #: (block, offset) of every new token's slot
    write_block: torch.Tensor
    write_offset: torch.Tensor
    #: per (window, from_cache), built by the first layer that attends with it
    prefill_plans: dict[tuple[int | None, bool], list[PrefillPlan]] = field(default_factory=dict)


def step_plan(meta: AttentionMetadata) -> StepPlan:
    return cast(StepPlan, meta.extras["torch_step_plan"])


def window_mask(q_pos: torch.Tensor, k_len: int, window: int | None) -> torch.Tensor:
    """bool [len(q_pos), k_len]: causal (key <= query) and, with a window, query - key < window."""
    k_pos = torch.arange(k_len, device=q_pos.device)
    diff = q_pos.unsqueeze(1) - k_pos.unsqueeze(0)
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    return mask


def length_buckets(lengths: list[int]) -> list[list[int]]:
    """Indices grouped by similar length (ascending), at most ``_MAX_BUCKETS`` groups."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    buckets: list[list[int]] = []
    for i in order:
        if buckets and (
            lengths[i] <= _BUCKET_GROWTH * lengths[buckets[-1][0]] or len(buckets) == _MAX_BUCKETS
        ):
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets
