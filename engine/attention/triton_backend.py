"""Paged attention on the Triton kernels (loaded by ``triton_loader``: compiled on CUDA, interpreted on
CPU). Decodes go to the split-KV decode kernel, prefill/extend sequences to one varlen prefill launch.
This module imports neither triton nor the kernels at import time, and queries CUDA only for a CUDA
device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from kvpilot.engine.attention.backend import AttentionBackend, LayerAttention
from kvpilot.engine.attention.kernels.launch_math import next_power_of_2
from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.engine.attention.triton_loader import TritonKernels, load_kernels
from kvpilot.engine.kv.kv_quant import KVQuant

if TYPE_CHECKING:  # the kernel modules are imported only through load_kernels
    from kvpilot.engine.attention.kernels.tuning import ConfigTable, KernelConfig

#: the head sizes the kernels keep in registers (padded to a power of two)
MAX_HEAD_DIM = 256


@dataclass
class _DecodePlan:
    """A step's ``split_kv.SplitPlan`` (kept as its two numbers: the kernel modules are imported only
    through ``load_kernels``) and the views of the split scratch it uses."""

    num_kv_splits: int = 1
    min_split_tokens: int = 1
    partials: tuple[torch.Tensor, torch.Tensor] | None = None


class TritonAttentionBackend(AttentionBackend):
    """Decodes go to the split-KV decode kernel, prefill/extend sequences to one varlen prefill launch.

    Each call's ``LayerAttention`` (window, scale, soft-cap) goes to the kernels as arguments; the split
    plan is made once per step, per sequence, from the backend's own window (it only sizes the work per
    program). The splits' partial results go to one scratch buffer kept across steps (grown, never
    reallocated per step).

    ``num_sms`` overrides the number of streaming multiprocessors the split-KV heuristic aims to fill
    (default: the GPU's; 1 on CPU, where the interpreter runs programs one after another).
    """

    name = "triton"
    supports_captured_decode = True

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        num_sms: int | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window)
        if not 1 <= head_dim <= MAX_HEAD_DIM:
            raise ValueError(f"head_dim must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
        if num_sms is not None and num_sms < 1:
            raise ValueError(f"num_sms must be positive, got {num_sms}")
        self._num_sms = num_sms
        self._kernels: TritonKernels | None = None
        self._configs: ConfigTable | None = None
        #: split-KV partial outputs and log-sum-exps, [rows, heads, MAX_KV_SPLITS, (head_dim)]
        self._partials: tuple[torch.Tensor, torch.Tensor] | None = None

    def kernels(self, device: torch.device) -> TritonKernels:
        if self._kernels is None:
            self._kernels = load_kernels(device)
            self._configs = self._kernels.tuning.ConfigTable()
        return self._kernels

    def _sm_count(self, device: torch.device) -> int:
        if self._num_sms is None:
            self._num_sms = (
                torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
            )
        return self._num_sms

    def _config(self, kernel: str, key_cache: torch.Tensor, windowed: bool) -> KernelConfig:
        kernels = self.kernels(key_cache.device)
        key = kernels.warmup.shape_key(
            self.head_dim,
            self.num_heads // self.num_kv_heads,
            key_cache.shape[1],
            key_cache.dtype,
            windowed,
        )
        default = kernels.tuning.DECODE_DEFAULT if kernel == "decode" else kernels.tuning.PREFILL_DEFAULT
        assert self._configs is not None  # made with the kernels
        return self._configs.get(kernel, key, default)

    def prepare(self, meta: AttentionMetadata) -> None:
        _check_metadata(meta)
        device = meta.seq_lens.device
        kernels = self.kernels(device)
        plan = _DecodePlan()
        if meta.num_decodes:
            split_kv = kernels.split_kv
            if meta.captured:  # replayed for other sequences: one plan for any contexts
                split = split_kv.plan_for_capture(meta.num_decodes, self.num_kv_heads, self._sm_count(device))
            else:
                active = split_kv.attended_keys(meta.seq_lens_host[: meta.num_decodes], self.sliding_window)
                split = split_kv.plan_kv_splits(active, self.num_kv_heads, self._sm_count(device))
            if split.num_kv_splits > 1:
                partials = self._split_scratch(meta.num_decodes, split.num_kv_splits, device)
                plan = _DecodePlan(split.num_kv_splits, split.min_split_tokens, partials)
        meta.extras["triton_decode_plan"] = plan

    def _split_scratch(
        self, rows: int, splits: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the kept scratch for ``rows`` sequences and ``splits`` splits (grown to the next power
        of two of rows when too small)."""
        if self._partials is None or self._partials[0].shape[0] < rows or self._partials[0].device != device:
            capacity = next_power_of_2(rows)
            split_kv = self.kernels(device).split_kv
            self._partials = split_kv.allocate_partials(
                capacity, self.num_heads, split_kv.MAX_KV_SPLITS, self.head_dim, device
            )
        partial_out, partial_lse = self._partials
        return partial_out[:rows, :, :splits], partial_lse[:rows, :, :splits]

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        quant: KVQuant | None = None,
    ) -> None:
        if "triton_decode_plan" not in meta.extras:
            self.prepare(meta)
        self._check_caches(key_cache, value_cache, meta, quant)
        expected = (meta.num_tokens, self.num_kv_heads, self.head_dim)
        for label, tensor in (("key", key), ("value", value)):
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"{label} must be [num_tokens, num_kv_heads, head_dim] = {list(expected)}, "
                    f"got {list(tensor.shape)}"
                )
            if tensor.device != key_cache.device:
                raise ValueError(f"{label} is on {tensor.device} but the cache is on {key_cache.device}")
        self.kernels(key_cache.device).kv_write.write_kv(
            key, value, key_cache, value_cache, meta.slot_mapping, quant
        )

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
        layer = layer or self.default_layer
        windowed = layer.sliding_window is not None
        self._check_caches(key_cache, value_cache, meta, quant)
        expected = (meta.num_tokens, self.num_heads, self.head_dim)
        if tuple(query.shape) != expected:
            raise ValueError(
                f"query must be [num_tokens, num_heads, head_dim] = {list(expected)}, got {list(query.shape)}"
            )
        if query.device != key_cache.device:
            raise ValueError(f"query is on {query.device} but the cache is on {key_cache.device}")
        if "triton_decode_plan" not in meta.extras:
            self.prepare(meta)
        kernels = self.kernels(query.device)
        out = torch.empty_like(query)
        decodes = meta.num_decodes
        if decodes:
            plan = cast(_DecodePlan, meta.extras["triton_decode_plan"])
            kernels.decode.paged_decode(
                out[:decodes],
                query[:decodes],
                key_cache,
                value_cache,
                meta.block_tables,
                meta.seq_lens,
                layer.scale,
                layer.sliding_window,
                plan.num_kv_splits,
                plan.partials,
                self._config("decode", key_cache, windowed),
                layer.logit_softcap,
                quant,
                plan.min_split_tokens,
            )
        if meta.num_seqs > decodes:
            kernels.prefill.paged_prefill(
                out,
                query,
                key_cache,
                value_cache,
                meta.block_tables[decodes:],
                meta.seq_lens[decodes:],
                meta.query_start_loc[decodes:],
                max(meta.query_lens_host[decodes:]),
                layer.scale,
                layer.sliding_window,
                self._config("prefill", key_cache, windowed),
                layer.logit_softcap,
                quant,
            )
        return out

    def warmup(
        self,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        """On CUDA, tune the kernels for this model's shapes; the interpreter has nothing to tune. A cache of
        fp8/int8 codes keeps the default tile configs (the tuner times float caches only)."""
        kernels = self.kernels(key_cache.device)
        quantized = key_cache.dtype in (torch.float8_e4m3fn, torch.int8)
        if key_cache.device.type != "cuda" or kernels.interpreted or quantized:
            return
        kernels.warmup.tune_served_shapes(
            self._configs,
            key_cache,
            value_cache,
            self.num_heads,
            self.scale,
            self.sliding_window,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            self._sm_count(key_cache.device),
        )

    def _check_caches(
        self,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        quant: KVQuant | None = None,
    ) -> None:
        supported = self.kernels(key_cache.device).tile_ops.SUPPORTED_CACHE_DTYPES
        if key_cache.dim() != 4 or key_cache.shape[1:] != (meta.block_size, self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"key_cache must be [num_blocks, block_size={meta.block_size}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}], "
                f"got {list(key_cache.shape)}"
            )
        if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
            raise ValueError(
                "value_cache must have key_cache's shape and dtype, got "
                f"{list(value_cache.shape)} {value_cache.dtype} vs {key_cache.dtype}"
            )
        if key_cache.dtype not in supported:
            raise ValueError(f"cache dtype must be one of {supported}, got {key_cache.dtype}")
        codes = {None: None, "fp8": torch.float8_e4m3fn, "int8": torch.int8}[
            None if quant is None else quant.dtype
        ]
        if (codes is None) != (key_cache.dtype not in (torch.float8_e4m3fn, torch.int8)) or (
            codes is not None and key_cache.dtype != codes
        ):
            raise ValueError(
                f"a {key_cache.dtype} cache cannot be read with kv quantization {quant and quant.dtype}"
            )
        if quant is not None and (quant.dtype == "int8" or quant.key_scales is not None):
            for scales in (quant.key_scales, quant.value_scales):
                if scales is None or scales.shape != key_cache.shape[:-1] or scales.dtype != torch.float32:
                    raise ValueError(f"per-row KV scales must be float32 {list(key_cache.shape[:-1])}")
        if value_cache.device != key_cache.device:
            raise ValueError(f"key_cache is on {key_cache.device} but value_cache on {value_cache.device}")


def _check_metadata(meta: AttentionMetadata) -> None:
    """Host-side checks of the step layout (no device sync): what the kernels rely on."""
    if meta.block_size < 1:
        raise ValueError(f"block_size must be positive, got {meta.block_size}")
    if len(meta.query_lens_host) != meta.num_seqs:
        raise ValueError(f"{len(meta.query_lens_host)} query lengths for {meta.num_seqs} sequences")
    if not 0 <= meta.num_decodes <= meta.num_seqs:
        raise ValueError(f"num_decodes={meta.num_decodes} outside 0..{meta.num_seqs}")
    if any(q != 1 for q in meta.query_lens_host[: meta.num_decodes]):
        raise ValueError("the leading num_decodes sequences must have exactly one new token each")
    if any(q < 1 or q > s for q, s in zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
        raise ValueError("every sequence needs 1 <= query length <= seq_len")
    if sum(meta.query_lens_host) != meta.num_tokens:
        raise ValueError(
            f"query lengths sum to {sum(meta.query_lens_host)}, but there are "
            f"{meta.num_tokens} slots in slot_mapping"
        )
    for label, tensor, dtype in (
        ("query_start_loc", meta.query_start_loc, torch.int32),
        ("seq_lens", meta.seq_lens, torch.int32),
        ("block_tables", meta.block_tables, torch.int32),
        ("slot_mapping", meta.slot_mapping, torch.int64),
    ):
        if tensor.dtype != dtype:
            raise ValueError(f"{label} must be {dtype}, got {tensor.dtype}")
        # the kernels step through these with unit stride
        if tensor.dim() and tensor.stride(-1) != 1:
            raise ValueError(f"{label} must be contiguous in its last dimension")
    if meta.block_tables.dim() != 2 or meta.block_tables.shape[0] < meta.num_seqs:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks], got {list(meta.block_tables.shape)}")
    if meta.block_tables.shape[1] * meta.block_size < meta.max_seq_len:
        raise ValueError(
            f"block_tables hold {meta.block_tables.shape[1]} blocks of {meta.block_size}, "
            f"fewer than the longest sequence ({meta.max_seq_len} tokens)"
        )
