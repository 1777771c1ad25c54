"""A decode-only step's decoder layers in one C call (``engine/native/decode_step.c``).

The native path (``DecoderLayer.forward_native``) calls ~10 kernels per layer from Python, each behind
its own checks; at batch 1 on SmolLM2 that glue measured ~4 ms of a ~20 ms step. ``NativeDecodeStep``
binds every layer's weights, RoPE tables and KV cache into C structs once, checks a step's inputs once
(not per layer), and runs the same kernels in the same order in C, so its hidden states are bit for bit
the Python path's (``tests/engine/test_native_decode.py``).

It takes dense llama-shaped models (no q/k norm, no Gemma norms, dense MLPs, one RMSNorm epsilon) whose
projections are native panel GEMMs (``PackedLinear``) or native quantized ones (``QuantLinear``: GGUF
blocks, int8 rows), on the torch attention backend with its native kernels; and steps where every
sequence decodes one token, within the projections' row limits. Everything else keeps the Python path
(``build`` says why in the log once).
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.engine.kv.kv_quant import LayerKV
from kvpilot.engine.model.cpu_linear import NATIVE_MAX_ROWS, PackedLinear
from kvpilot.engine.model.layers import MLP
from kvpilot.engine.model.quant_linear import QUANT_NATIVE_MAX_ROWS, QuantLinear, SplitQuantLinear
from kvpilot.engine.native.decode_step_ops import MAX_PARTS, LayerView, LinearView, ModelView, PartView
from kvpilot.engine.native.kv_args import kv_cache_args
from kvpilot.engine.native.ops import NativeOps
from kvpilot.engine.native.paged_attention_ops import MAX_GROUP, MAX_HEAD_DIM, check_block_tables
from kvpilot.engine.native.quant_ops import FORMATS, check_weight

if TYPE_CHECKING:
    from kvpilot.engine.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _tensor(module: nn.Module, name: str) -> torch.Tensor | None:
    """A buffer of ``module`` (None when it is unset)."""
    value = getattr(module, name)
    assert value is None or isinstance(value, torch.Tensor)
    return value


def _bind_part(module: nn.Module) -> tuple[PartView, int] | None:
    """The C view of one stored weight and the most rows its kernel takes; None for other modules."""
    if isinstance(module, PackedLinear) and module.native is not None:
        view = PartView(_ptr(_tensor(module, "panel_weight")), None, module.out_features, -1)
        return view, NATIVE_MAX_ROWS
    if isinstance(module, QuantLinear) and module.native is not None:
        data, scales = _tensor(module, "qweight"), _tensor(module, "scales")
        assert data is not None
        vnni = module.vnni_weight
        if vnni is not None:  # the int8-activation GEMM (any row count) reads only the packed tiles
            code = FORMATS[module.format].code
            view = PartView(None, _ptr(scales), module.out_features, code, _ptr(vnni.packed), vnni.kind)
            return view, NATIVE_MAX_ROWS
        code = check_weight(data, scales, module.format, module.in_features).code
        return PartView(data.data_ptr(), _ptr(scales), module.out_features, code), QUANT_NATIVE_MAX_ROWS
    return None


def _is_float32_vector(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 1 and t.is_contiguous()


def _bind_linear(module: nn.Module) -> tuple[LinearView, int] | None:
    """The C view of one projection (a split one: its parts) and the most rows its kernels take."""
    parts = list(module.parts) if isinstance(module, SplitQuantLinear) else [module]
    if len(parts) > MAX_PARTS:
        return None
    bound = [_bind_part(p) for p in parts]
    bias = _tensor(module, "bias")
    if any(b is None for b in bound) or (bias is not None and not _is_float32_vector(bias)):
        return None
    views = [b[0] for b in bound if b is not None]
    array = (PartView * MAX_PARTS)(*views)
    view = LinearView(array, len(views), _ptr(bias), module.out_features, module.in_features)
    return view, min(b[1] for b in bound if b is not None)


class NativeDecodeStep:
    """The bound layers of one model; ``run`` is one decode-only step through them."""

    def __init__(
        self, model: LlamaForCausalLM, native: NativeOps, layers: list[LayerView], max_rows: int
    ) -> None:
        arch = model.arch
        self._model = model
        self._fn = native.decode_step
        self._layers = (LayerView * len(layers))(*layers)
        self._dims = ModelView(
            len(layers),
            arch.hidden_size,
            arch.num_attention_heads,
            arch.num_key_value_heads,
            arch.head_dim,
            arch.intermediate_size,
            0,  # the block size: bound with the caches
            model.norm.eps,
            model.norm.weight.data_ptr(),
        )
        #: most sequences one call takes (the projections' kernels' limit)
        self.max_rows = max_rows
        # the C structs hold raw pointers: keep every bound tensor alive as long as they are used
        self._bound_tensors = [t for m in model.modules() for t in (*m.parameters(False), *m.buffers(False))]
        self._bound_caches: tuple[int, ...] = ()
        self._scratch = torch.empty(0)
        self._max_position = min(r.cos.shape[0] for r in model.rotary_tables)

    @classmethod
    def build(cls, model: LlamaForCausalLM, native: NativeOps) -> NativeDecodeStep | None:
        """The bound step for ``model``, or None (logged) when it is not the shape the C loop runs."""
        why = _unsupported(model)
        if why is not None:
            log.info("native decode step: off (%s); decode runs layer by layer", why)
            return None
        layers, max_rows = [], NATIVE_MAX_ROWS
        for i, layer in enumerate(model.decoder_layers):
            attn, mlp = layer.self_attn, layer.mlp
            assert isinstance(mlp, MLP)  # _unsupported said so
            bound = [_bind_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(b is None for b in bound):
                log.info("native decode step: off (layer %d has a projection without a native kernel)", i)
                return None
            views = [b[0] for b in bound if b is not None]
            max_rows = min([max_rows, *(b[1] for b in bound if b is not None)])
            rotary = model.rotary_tables[model.layer_rotary[i]]
            cos, sin = rotary.cos, rotary.sin
            params = attn.params
            layers.append(
                LayerView(
                    input_norm=layer.input_layernorm.weight.data_ptr(),
                    post_attention_norm=layer.post_attention_layernorm.weight.data_ptr(),
                    qkv=views[0],
                    o=views[1],
                    gate_up=views[2],
                    down=views[3],
                    cos=cos.data_ptr(),
                    sin=sin.data_ptr(),
                    rotary_dims=cos.shape[1],
                    attn_scale=params.scale,
                    softcap=params.logit_softcap or 0.0,
                    window=params.sliding_window or 0,
                )
            )
        return cls(model, native, layers, max_rows)

    def accepts(self, meta: AttentionMetadata) -> bool:
        """Whether this step is one this loop runs: every sequence decodes one token, within the rows."""
        tokens = meta.num_tokens
        return 0 < tokens <= self.max_rows and meta.num_decodes == meta.num_seqs == tokens

    def run(
        self,
        residual: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKV],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The final norm of the hidden states after every layer, for ``residual`` (the step's embeddings,
        ``[T, hidden]`` contiguous float32; it accumulates the layers' outputs in place)."""
        tokens = residual.shape[0]
        self._bind_caches(kv_caches)
        self._check_step(residual, positions, kv_caches[0], meta)
        need = self._fn.scratch(ctypes.byref(self._dims), tokens)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need)
        out = torch.empty_like(residual)
        status = self._fn.step(
            ctypes.byref(self._dims),
            self._layers,
            tokens,
            residual.data_ptr(),
            positions.data_ptr(),
            meta.slot_mapping.data_ptr(),
            meta.block_tables.data_ptr(),
            meta.block_tables.stride(0),
            meta.seq_lens.data_ptr(),
            self._scratch.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status == -1:
            raise MemoryError("decode attention could not allocate its row buffers")
        if status:
            raise ValueError(f"kvp_decode_step failed with status {status}")
        return out

    def _bind_caches(self, kv_caches: list[LayerKV]) -> None:
        """Point the layers at the caches (again only when the engine handed other tensors)."""
        key = tuple(p for c in kv_caches for p in (c.key.data_ptr(), c.value.data_ptr()))
        if key == self._bound_caches:
            return
        if len(kv_caches) != len(self._layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self._layers)} layers")
        shape = kv_caches[0].key.shape
        for layer, cache in zip(self._layers, kv_caches, strict=True):
            if cache.key.shape != shape:
                raise ValueError("every layer's KV cache must have the same shape")
            kind, k_rows, v_rows, k_scale, v_scale = kv_cache_args(cache.key, cache.value, cache.quant)
            layer.key_cache, layer.value_cache = cache.key.data_ptr(), cache.value.data_ptr()
            layer.k_rows, layer.v_rows, layer.k_scale, layer.v_scale = k_rows, v_rows, k_scale, v_scale
            layer.kv_kind = kind
        self._dims.block_size = shape[2]  # HND: [blocks, kv_heads, block_size, head_dim]
        if shape[1] != self._dims.num_kv_heads or shape[3] != self._dims.head_dim:
            raise ValueError(f"the KV cache {tuple(shape)} does not hold this model's heads (HND layout)")
        self._bound_caches = key

    def _check_step(
        self, residual: torch.Tensor, positions: torch.Tensor, cache: LayerKV, meta: AttentionMetadata
    ) -> None:
        """What the kernels assume of this step's inputs, checked once for all layers."""
        tokens, hidden = residual.shape
        if residual.dtype != torch.float32 or not residual.is_contiguous() or hidden != self._dims.hidden:
            raise ValueError(f"residual must be contiguous float32 [T, {self._dims.hidden}]")
        for t, name, dtype in (
            (positions, "positions", torch.int64),
            (meta.slot_mapping, "slot_mapping", torch.int64),
            (meta.seq_lens, "seq_lens", torch.int32),
        ):
            if t.dtype != dtype or not t.is_contiguous() or t.numel() < tokens:
                raise ValueError(f"{name} must be contiguous {dtype} with {tokens} entries")
        tables = meta.block_tables
        rows_ok = tables.dim() == 2 and tables.stride(1) == 1 and tables.shape[0] >= tokens
        if tables.dtype != torch.int32 or not rows_ok:
            raise ValueError(f"block_tables must be int32 [>= {tokens}, max_blocks] with contiguous rows")
        num_blocks, _, block_size, _ = cache.key.shape
        if not 0 <= int(positions.min()) <= int(positions.max()) < self._max_position:
            raise ValueError(f"positions must lie in [0, {self._max_position})")
        if int(meta.slot_mapping.max()) >= num_blocks * block_size:
            raise ValueError(f"a slot is outside the cache ({num_blocks * block_size} slots)")
        check_block_tables(tables[:tokens], max(meta.seq_lens_host), cache.key)


def _unsupported(model: LlamaForCausalLM) -> str | None:
    """Why ``model`` is not a shape the C loop runs, or None when it is."""
    arch = model.arch
    backend = model.backend
    if getattr(backend, "native", None) is None or getattr(backend, "kv_cache_layout", None) != "HND":
        return "the attention backend is not the torch backend with native kernels"
    if model.logits_gather is not None:
        return "tensor parallelism"
    if arch.qk_norm or arch.gemma_norms or model.embed_scale is not None:
        return "q/k norms or Gemma's norms"
    if arch.hidden_act != "silu":
        return f"activation {arch.hidden_act}"
    heads, kv_heads, head_dim = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    if heads % kv_heads or heads // kv_heads > MAX_GROUP or head_dim > MAX_HEAD_DIM:
        return f"{heads} query heads over {kv_heads} KV heads of {head_dim} (decode attention's limits)"
    eps = model.norm.eps
    norms = [model.norm]
    for layer in model.decoder_layers:
        if not isinstance(layer.mlp, MLP):
            return "Mixture-of-Experts layers"
        if layer.input_layernorm.eps != eps or layer.post_attention_layernorm.eps != eps:
            return "RMSNorm epsilons differ between norms"
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
    if not all(_is_float32_vector(norm.weight) for norm in norms):
        return "RMSNorm weights are not contiguous float32"
    for rotary in model.rotary_tables:
        cos, sin = rotary.cos, rotary.sin
        if any(t.dtype != torch.float32 or not t.is_contiguous() or t.dim() != 2 for t in (cos, sin)):
            return "RoPE tables are not contiguous float32"
        if cos.shape[1] % 2 or not 0 < cos.shape[1] <= head_dim:
            return f"rotary dims {cos.shape[1]} for heads of {head_dim}"
    return None
