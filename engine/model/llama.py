"""The decoder-only transformer over a flattened, paged batch: every family of docs/models.md.

The forward pass takes the step's tokens of all sequences flattened into one ``[num_tokens]`` vector
(prefill chunks and decode tokens together); every op except attention is per token, so only attention
needs the per-sequence layout (``AttentionMetadata``) and the paged KV cache. The layers are
``layers.DecoderLayer``; this module adds the embedding (scaled by √hidden for Gemma), the rotary tables
(one per distinct RoPE of the model's layer types: Gemma 3's local and global layers rotate with different
bases), the final norm and the LM head (soft-capped for Gemma 2).

With ``native`` set (float32 on CPU, ``kvpilot.engine.native``), the same computation runs through fused
C kernels (``DecoderLayer.forward_native``). Every dense family runs there. A decode-only step of a
llama-shaped model goes further: all its layers in one C call (``native_decode``), bit for bit the same.
On CUDA with the Triton attention backend, ``fused_ops`` runs the same fused path on Triton kernels
(``fused_triton``: add + RMSNorm, RoPE in place, the gated activation, one launch each).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.engine.attention.backend import AttentionBackend
from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.engine.kv.kv_quant import LayerKV
from kvpilot.engine.model.arch import ModelArchConfig
from kvpilot.engine.model.layers import MLP, Attention, DecoderLayer, FusedOps, RMSNorm
from kvpilot.engine.model.native_decode import NativeDecodeStep
from kvpilot.engine.model.rope import RotaryEmbedding
from kvpilot.engine.model.weights import load_hf_weights
from kvpilot.engine.native.ops import NativeOps

__all__ = ["MLP", "Attention", "DecoderLayer", "LlamaForCausalLM", "RMSNorm"]

_LM_HEAD_SLAB_ROWS = 2048


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. ``forward`` returns hidden states; ``compute_logits`` projects selected rows."""

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, backend: AttentionBackend) -> None:
        super().__init__()
        self.arch = arch
        self.backend = backend
        #: an nn.Embedding as built; loading may replace it (quantized, vocabulary-parallel lookups)
        self.embed_tokens: nn.Module = nn.Embedding(arch.vocab_size, arch.hidden_size)
        decoder = [DecoderLayer(arch, i) for i in range(arch.num_hidden_layers)]
        self.layers = nn.ModuleList(decoder)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.gemma_norms)
        self.lm_head = (
            None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        )
        #: Gemma multiplies the embeddings by √hidden, rounded to the activation dtype as HF does
        self.embed_scale = torch.tensor(arch.hidden_size**0.5).to(dtype).item() if arch.gemma_norms else None
        # float32 tables computed as HF computes them, whatever device the model is on
        specs: list[tuple[float, dict | None]] = []
        for layer in decoder:
            if layer.self_attn.rope_spec not in specs:
                specs.append(layer.self_attn.rope_spec)
        with torch.device("cpu"):
            self.rotaries = nn.ModuleList(
                RotaryEmbedding(arch.rotary_dim, arch.max_position_embeddings, theta, scaling, dtype)
                for theta, scaling in specs
            )
        #: per layer, its index into ``rotaries``
        self.layer_rotary = [specs.index(layer.self_attn.rope_spec) for layer in decoder]
        #: an optimised copy of the LM head (e.g. oneDNN-packed on CPU); None = use the weight directly
        self.packed_lm_head: nn.Module | None = None
        #: fused C kernels (float32 on CPU); None = PyTorch ops
        self.native: NativeOps | None = None
        #: the fused layer path's element-wise kernels where the C kernels do not run (Triton on CUDA,
        #: ``fused_triton``); None = PyTorch ops
        self.fused_ops: FusedOps | None = None
        #: decode-only steps' layers in one C call (``native_decode``): None until the first native step
        #: binds it, False when this model is not a shape it runs
        self.decode_step: NativeDecodeStep | Literal[False] | None = None
        #: a tensor-parallel rank's logits → the full vocabulary's on rank 0, no rows elsewhere
        #: (``distributed.layers.LogitsGather``); None = this model is the whole model
        self.logits_gather: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def rotary(self) -> RotaryEmbedding:
        """The global layers' rotary tables (all layers' but Gemma 3's local ones)."""
        return self.rotary_tables[self.layer_rotary[-1]]

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """``layers`` as what they are (an ``nn.ModuleList`` types its items as ``Module``)."""
        return cast("list[DecoderLayer]", list(self.layers))

    @property
    def rotary_tables(self) -> list[RotaryEmbedding]:
        """``rotaries``, typed likewise."""
        return cast("list[RotaryEmbedding]", list(self.rotaries))

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKV],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        self.backend.prepare(meta)
        ops = self.native if self.native is not None else self.fused_ops
        if ops is not None:
            return self._forward_native(input_ids, positions, kv_caches, meta, ops)
        tables = [rotary.tables(positions) for rotary in self.rotary_tables]
        hidden = self._embed(input_ids)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            hidden = layer(hidden, tables[self.layer_rotary[i]], self.backend, kv_cache, meta)
        return self.norm(hidden)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        return hidden if self.embed_scale is None else hidden * self.embed_scale

    def _forward_native(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKV],
        meta: AttentionMetadata,
        native: FusedOps,
    ) -> torch.Tensor:
        """``forward`` through the fused kernels: ``residual`` accumulates the sublayer outputs in place and
        every RMSNorm reads it right after the add (the next layer's input norm, finally ``self.norm``)."""
        residual = self._embed(input_ids).contiguous()
        if self.decode_step is None:  # bound on the first step: the backend gets its kernels after loading
            c_loop = NativeDecodeStep.build(self, native) if isinstance(native, NativeOps) else None
            self.decode_step = c_loop or False
        if self.decode_step and self.decode_step.accepts(meta):
            return self.decode_step.run(residual, positions, kv_caches, meta)
        layers, rotaries = self.decoder_layers, self.rotary_tables
        first = layers[0].input_layernorm
        hidden = native.add_rms_norm(residual, None, first.scale(), first.eps)
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            hidden = layer.forward_native(
                residual,
                hidden,
                positions,
                rotaries[self.layer_rotary[i]],
                self.backend,
                kv_cache,
                meta,
                native,
                next_norm,
            )
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of ``hidden``'s rows (under tensor parallelism: on rank 0; no rows elsewhere)."""
        logits = self._lm_head(hidden)
        cap = self.arch.final_logit_softcap
        logits = logits if cap is None else torch.tanh(logits / cap) * cap
        return logits if self.logits_gather is None else self.logits_gather(logits)

    def _lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_lm_head is not None:
            return self.packed_lm_head(hidden).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        assert isinstance(weight, torch.Tensor), "a quantized LM head is a packed_lm_head"
        if hidden.device.type != "cpu":
            return F.linear(hidden, weight).float()
        # On CPU one GEMM against the whole [vocab, hidden] matrix streams it through the caches badly;
        # slabs of vocab rows that stay cache-resident are ~25% faster (measured: 48 → 36 ms for
        # 32 × 576 × 49152 on 2 cores). Each logit is still one dot product, so values are unchanged.
        out = torch.empty(hidden.shape[0], weight.shape[0], dtype=hidden.dtype, device=hidden.device)
        for start in range(0, weight.shape[0], _LM_HEAD_SLAB_ROWS):
            end = min(start + _LM_HEAD_SLAB_ROWS, weight.shape[0])
            torch.mm(hidden, weight[start:end].t(), out=out[:, start:end])
        return out.float()

    def load_hf_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy an HF-named state dict in (``weights.load_hf_weights``)."""
        load_hf_weights(self, tensors)
