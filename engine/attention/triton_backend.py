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
from kvpilot.engine.attention.rotation import QKRotation
from kvpilot.engine.attention.triton_checks import check_caches, check_metadata, check_rows
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
    rotates_in_kv_write = True

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
        check_metadata(meta)
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
        self._write(key, value, key_cache, value_cache, meta, quant, None, None)

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
        self._write(key, value, key_cache, value_cache, meta, quant, query, rotation)
        return self.attend(query, key, value, key_cache, value_cache, meta, layer, quant)

    def _write(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        quant: KVQuant | None,
        query: torch.Tensor | None,
        rotation: QKRotation | None,
    ) -> None:
        if "triton_decode_plan" not in meta.extras:
            self.prepare(meta)
        self._check_caches(key_cache, value_cache, meta, quant)
        kv_rows = (meta.num_tokens, self.num_kv_heads, self.head_dim)
        check_rows("key", key, "num_tokens, num_kv_heads, head_dim", kv_rows, key_cache.device)
        check_rows("value", value, "num_tokens, num_kv_heads, head_dim", kv_rows, key_cache.device)
        if rotation is not None:
            check_rows(
                "query", query, "num_tokens, num_heads, head_dim", self._query_rows(meta), key_cache.device
            )
            check_rows("positions", rotation.positions, "num_tokens", (meta.num_tokens,), key_cache.device)
        self.kernels(key_cache.device).kv_write.write_kv(
            key, value, key_cache, value_cache, meta.slot_mapping, quant, query, rotation
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
        check_rows(
            "query", query, "num_tokens, num_heads, head_dim", self._query_rows(meta), key_cache.device
        )
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

    def _query_rows(self, meta: AttentionMetadata) -> tuple[int, int, int]:
        return (meta.num_tokens, self.num_heads, self.head_dim)

    def _check_caches(
        self,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        quant: KVQuant | None,
    ) -> None:
        supported = self.kernels(key_cache.device).tile_ops.SUPPORTED_CACHE_DTYPES
        check_caches(
            key_cache, value_cache, meta.block_size, self.num_kv_heads, self.head_dim, supported, quant
        )
