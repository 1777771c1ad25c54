"""The rotary embedding a layer hands to the attention backend, for backends that apply it inside their
KV write (``AttentionBackend.rotates_in_kv_write``): one launch rotates q and k in place and writes the
rotated keys, instead of a RoPE pass over q and k and then the write (docs/architecture.md, "Captured
decode").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QKRotation:
    """Rotate-half RoPE at each token's position: ``cos``/``sin`` are ``[max_position, rotary]`` tables
    (``rotary`` even, up to the head size: narrower tables rotate each head's first dims only), read at
    ``positions`` ``[num_tokens]``."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    def rotary_dim(self, head_dim: int, num_tokens: int) -> int:
        """The dims each head rotates; ``ValueError`` when the tables or positions do not fit a step of
        ``num_tokens`` tokens with heads of ``head_dim``."""
        cos, sin = self.cos, self.sin
        rotary = cos.shape[1] if cos.dim() == 2 else 0
        if rotary % 2 or not 0 < rotary <= head_dim:
            raise ValueError(
                f"rotary tables must be [max_position, rotary] with rotary even and at most the head size "
                f"{head_dim}, got {list(cos.shape)}"
            )
        if sin.shape != cos.shape or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("cos and sin must be contiguous tables of one shape")
        positions = self.positions
        if positions.shape != (num_tokens,) or positions.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"positions must be integer [{num_tokens}], got {positions.dtype} {list(positions.shape)}"
            )
        if num_tokens > 1 and positions.stride(0) != 1:  # the kernel reads them at unit stride
            raise ValueError(f"positions must be contiguous, got stride {positions.stride(0)}")
        if not self.positions.device == cos.device == sin.device:
            raise ValueError("positions and the rotary tables must be on one device")
        return rotary
