"""Rotary position embeddings with the config's theta and scaling (HF ``rope_scaling`` semantics).

Rotation uses the "rotate half" convention of HF Llama checkpoints: the head dimension is split into two
halves that pair up (x[i], x[i + d/2]). GGUF checkpoints are converted to this convention on load.
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


def _yarn_inv_freq(head_dim: int, theta: float, s: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    factor = float(s["factor"])
    old_ctx = float(s.get("original_max_position_embeddings") or max_pos / factor)
    beta_fast, beta_slow = float(s.get("beta_fast", 32)), float(s.get("beta_slow", 1))

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), head_dim - 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)
    extrapolation_weight = 1 - ramp.clamp(0, 1)
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    attention_factor = float(s.get("attention_factor") or (0.1 * math.log(factor) + 1.0))
    return inv_freq, attention_factor


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  max_position: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32) and the cos/sin magnitude factor for a RoPE configuration."""
    inv_freq = _default_inv_freq(head_dim, theta)
    if not scaling:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, max_position)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3, yarn")


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq, magnitude = rope_inv_freq(head_dim, theta, scaling, max_position)
        # tables in float32 (as HF), then cast to the activation dtype
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.float())
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", (emb.cos() * magnitude).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * magnitude).to(dtype), persistent=False)
        self.max_position = max_position

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows ``[T, 1, D]`` for the tokens' positions; looked up once per step, used by every layer."""
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)

    @staticmethod
    def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` [T, Hq, D] and ``k`` [T, Hkv, D] with the step's ``tables``."""
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
