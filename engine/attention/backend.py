"""The attention-backend interface and backend selection.

A backend does two things per layer: write the step's new K/V into their cache slots, then attend each
new query token over its sequence's paged context. ``prepare`` runs once per step (all layers share the
same layout), so per-step index arithmetic is not repeated 30 times.

Layers of one model may attend differently (docs/architecture.md#model-families): Gemma's alternate a
sliding window with global attention and soft-cap their logits. Each layer passes its ``LayerAttention``
to ``forward``/``attend``; without one, the backend's own scale and window apply.

A quantized cache (``kv_cache_dtype`` fp8/int8, docs/architecture.md#kv-cache-dtype) holds codes; the
layer's ``KVQuant`` (its scales) goes with the caches to ``write_kv``/``attend``, which quantize on write and
dequantize on read. None means the caches hold values in a float dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.engine.attention.rotation import QKRotation
from kvpilot.engine.kv.kv_quant import KVQuant

BACKEND_NAMES = ("auto", "torch", "triton")


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends."""

    #: multiplies q·k before the softmax
    scale: float
    #: a query at position i attends keys at positions j with i - sliding_window < j <= i; None = all j <= i
    sliding_window: int | None = None
    #: scores s become cap * tanh(s / cap) after scaling and before masking (Gemma 2); None = off
    logit_softcap: float | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {self.sliding_window}")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"logit_softcap must be positive, got {self.logit_softcap}")


class AttentionBackend(ABC):
    """Paged attention for one model: same head counts and head_dim in every layer."""

    name: str = "abstract"
    #: per-layer cache layout this backend reads: "NHD" = [num_blocks, block_size, kv_heads, head_dim]
    #: (the layout GPU kernels use), "HND" = [num_blocks, kv_heads, block_size, head_dim]
    kv_cache_layout: str = "NHD"
    #: a decode-only step on this backend may be captured into a CUDA graph (``meta.captured``): its
    #: launches depend only on tensor shapes and device data, never on the host lists of the metadata
    supports_captured_decode: bool = False
    #: ``forward`` takes a ``QKRotation`` and applies it to q and k inside its KV write (one launch for
    #: the layer's RoPE and K/V write); other backends get q and k already rotated
    rotates_in_kv_write: bool = False

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        #: a query at position i attends keys at positions j with i - sliding_window < j <= i
        self.sliding_window = sliding_window
        #: what a call without its own ``LayerAttention`` does
        self.default_layer = LayerAttention(scale, sliding_window)

    def prepare(self, meta: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Per-step precomputation shared by all layers (stores results in ``meta.extras``)."""

    def warmup(  # noqa: B027 - optional hook with a no-op default
        self,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        """Optional: compile/tune kernels for the served shapes before the engine reports ready.

        Called once with one layer's caches (all layers share their shape); it may read them but must
        leave their contents alone. The default has nothing to prepare."""

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        quant: KVQuant | None = None,
    ) -> None:
        """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into ``meta.slot_mapping``
        (quantized with ``quant``'s scales, writing int8's per-slot scales, when given)."""

    @abstractmethod
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
        """Attention output ``[num_tokens, num_heads, head_dim]`` for ``query`` ``[num_tokens, num_heads,
        head_dim]``. ``key``/``value`` are this step's new K/V (already written to the cache); ``layer``
        (default ``default_layer``) says how this layer attends; ``quant`` how the caches' codes read."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        layer: LayerAttention | None = None,
        quant: KVQuant | None = None,
        rotation: QKRotation | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V, then attend. ``rotation`` (only where ``rotates_in_kv_write``) rotates
        ``query`` and ``key`` in place first."""
        if rotation is not None:
            raise ValueError(f"the {self.name} attention backend does not rotate q and k in its KV write")
        self.write_kv(key, value, key_cache, value_cache, meta, quant)
        return self.attend(query, key, value, key_cache, value_cache, meta, layer, quant)


def resolve_backend_name(name: str, device: torch.device) -> str:
    """``auto`` is triton on CUDA and torch elsewhere. Never queries CUDA unless the device is CUDA."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


def select_backend(name: str, device: torch.device, **kwargs: Any) -> AttentionBackend:
    """The backend ``name`` resolves to on ``device``, built with ``kwargs`` (head counts, head size,
    scale, window)."""
    resolved = resolve_backend_name(name, device)
    if resolved == "torch":
        from kvpilot.engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(**kwargs)
    from kvpilot.engine.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(**kwargs)
