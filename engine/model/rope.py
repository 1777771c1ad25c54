"""Rotary position embeddings: the config's RoPE parameters (both HF config forms) and the cos/sin tables.

Rotation uses the "rotate half" convention of HF Llama checkpoints: the head dimension is split into two
halves that pair up (x[i], x[i + d/2]). GGUF checkpoints are converted to this convention on load.

The RoPE parameters come from ``rope_config.rope_settings`` (either HF config form, defaults filled in).

Dynamic NTK scaling: HF recomputes the base from the forward's longest position, so its result depends on
how tokens are batched. Here each position p is rotated with the base for a sequence of length
max(p + 1, original context): identical to HF for every token generated one at a time and for any prefix
within the original context, and independent of batching and chunked prefill. (HF's one-shot forward of
a prompt longer than the original context rotates all of it with the prompt length's base instead.)

LongRoPE (Phi-3's ``longrope``/``su``) follows the same rule: HF switches from ``short_factor`` to
``long_factor`` once the sequence outgrows ``original_max_position_embeddings``, so here positions below it
use the short factors and positions from it on the long ones (docs/models.md#phi-3).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    # float32 exactly as HF computes it, so fp32 runs are bit-comparable with the reference model
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    head_dim: int, theta: float, s: dict[str, Any], max_pos: int
) -> tuple[torch.Tensor, float]:
    old_ctx = float(s["original_max_position_embeddings"])
    factor = float(s.get("factor") or max_pos / old_ctx)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)
    extrapolation_weight = 1 - ramp.clamp(0, 1)
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(
                factor, float(mscale_all_dim)
            )
        else:
            attention_factor = _yarn_mscale(factor)
    return inv_freq, float(attention_factor)


def _dynamic_freqs(head_dim: int, theta: float, s: dict[str, Any], max_position: int) -> torch.Tensor:
    """[max_position, head_dim/2] angles: row p uses the NTK base of a max(p + 1, original)-token sequence."""
    factor, old_ctx = float(s["factor"]), int(s["original_max_position_embeddings"])
    positions = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(positions, _default_inv_freq(head_dim, theta))
    if max_position > old_ctx:
        # HF's arithmetic, in float32 as HF does it: base * ((f * L / L0) - (f - 1)) ** (d / (d - 2))
        lengths = torch.arange(old_ctx + 1, max_position + 1, dtype=torch.int64)
        bases = theta * ((factor * lengths / old_ctx) - (factor - 1)) ** (head_dim / (head_dim - 2))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv = 1.0 / (bases.unsqueeze(1) ** exponents)
        freqs[old_ctx:] = positions[old_ctx:].unsqueeze(1) * inv
    return freqs


def _longrope_freqs(
    head_dim: int, theta: float, s: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    """[max_position, head_dim/2] angles: short factors below the original context, long from it on."""
    old_ctx = int(s["original_max_position_embeddings"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    positions = torch.arange(max_position, dtype=torch.float32)
    short = 1.0 / (torch.tensor(s["short_factor"], dtype=torch.float32) * theta**exponents)
    long = 1.0 / (torch.tensor(s["long_factor"], dtype=torch.float32) * theta**exponents)
    freqs = torch.outer(positions, short)
    if max_position > old_ctx:
        freqs[old_ctx:] = torch.outer(positions[old_ctx:], long)
    factor = float(s.get("factor") or float(s["max_position_embeddings"]) / old_ctx)
    magnitude = s.get("attention_factor")
    if magnitude is None:  # HF's default: sqrt(1 + ln(factor) / ln(original context)) when extending
        magnitude = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))
    return freqs, float(magnitude)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32) and the cos/sin magnitude factor of a position-independent RoPE."""
    inv_freq = _default_inv_freq(head_dim, theta)
    if not scaling:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, max_position)
    raise ValueError(f"RoPE type {kind!r} has position-dependent frequencies; use rope_angles")


def rope_angles(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position: int
) -> tuple[torch.Tensor, float]:
    """[max_position, head_dim/2] rotation angles (float32) and the cos/sin magnitude factor."""
    if scaling and scaling["rope_type"] == "dynamic":
        return _dynamic_freqs(head_dim, theta, scaling, max_position), 1.0
    if scaling and scaling["rope_type"] == "longrope":
        return _longrope_freqs(head_dim, theta, scaling, max_position)
    inv_freq, magnitude = rope_inv_freq(head_dim, theta, scaling, max_position)
    return torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.float()), magnitude


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by absolute position."""

    #: ``[max_position, rotary_dim]`` tables in the activation dtype (buffers, not saved with the weights)
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        # tables in float32 (as HF), then cast to the activation dtype
        freqs, magnitude = rope_angles(head_dim, theta, scaling, max_position)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", (emb.cos() * magnitude).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * magnitude).to(dtype), persistent=False)
        self.max_position = max_position

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows ``[T, 1, D]`` for the tokens' positions; looked up once per step, used by every
        layer."""
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(
            0, positions
        ).unsqueeze(1)

    @staticmethod
    def rotate(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` [T, Hq, D] and ``k`` [T, Hkv, D] with the step's ``tables``; tables narrower than D
        rotate each head's first dims only (partial rotary, as HF's Phi3)."""
        rot = cos.shape[-1]
        if rot == q.shape[-1]:
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        q_rot, k_rot = q[..., :rot], k[..., :rot]
        return (
            torch.cat((q_rot * cos + _rotate_half(q_rot) * sin, q[..., rot:]), dim=-1),
            torch.cat((k_rot * cos + _rotate_half(k_rot) * sin, k[..., rot:]), dim=-1),
        )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_width(x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor) -> int:
    """The dims each head rotates for an in-place RoPE kernel over ``x``'s rows (``num_heads`` heads of
    ``head_dim`` leading each row) with a ``[max_position, rotary]`` table; ``ValueError`` when they do
    not fit (what the fused kernels check before launching)."""
    rotary = cos.shape[1] if cos.dim() == 2 else 0
    if x.dim() != 2 or x.shape[1] < num_heads * head_dim or rotary % 2 or not 0 < rotary <= head_dim:
        raise ValueError(
            f"x rows ({x.shape[-1]}) must hold {num_heads} heads of {head_dim}, each rotated over an even "
            f"number of dims up to {head_dim} (the tables' width, {rotary})"
        )
    return rotary
