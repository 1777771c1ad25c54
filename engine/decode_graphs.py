"""Captured decode: the model's forward for decode-only steps recorded once per bucketed batch size and
replayed, so a decode step costs the host a few copies and one launch instead of ~11 launches a layer
(docs/architecture.md#captured-decode).

A graph replays fixed launches over fixed addresses, so each bucket owns static inputs (token ids,
positions, slots, context lengths, block tables: rows of buffers sized for the largest bucket) and
attention metadata marked ``captured`` (the attention backend then plans its launches for any context
lengths). A step of ``n`` decodes runs in the smallest bucket ``B >= n``: its rows are copied in, and the
``B - n`` padding rows are placeholder sequences of one token in the reserved block 0 (slot 0, context
1), which no live sequence reads. The hidden states of the first ``n`` rows come back; logits and
sampling stay outside the graph. Prefill, mixed and speculative steps, and steps above the largest
bucket, run eagerly.

Graphs are captured by the server's warm-up right after its kernel tuning (whose tile configs they bake
in), or else on the first decode-only step, largest bucket first, sharing one memory pool. A capture
that fails (an op that reads the device from the host, say) is logged and the engine stays eager.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvpilot.engine.attention.kernels.launch_math import cdiv
from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.engine.config import EngineConfig
from kvpilot.engine.input_batch import StepBatch
from kvpilot.engine.kv.kv_cache import KVCache
from kvpilot.engine.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

#: largest default bucket: beyond it a decode step's launches are long enough to hide the host's work
DEFAULT_MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, sizes: Sequence[int] = ()) -> list[int]:
    """The batch sizes to capture, ascending: ``sizes`` when given, else vLLM's buckets (1, 2, 4, then
    every multiple of 8) up to ``max_num_seqs`` capped at ``DEFAULT_MAX_CAPTURE_SIZE``; that top is
    itself a bucket, so a full batch within the cap is never eager."""
    if sizes:
        if min(sizes) < 1 or max(sizes) > max_num_seqs:
            raise ValueError(f"cuda_graph_sizes must be in 1..max_num_seqs={max_num_seqs}, got {list(sizes)}")
        return sorted(set(sizes))
    top = min(max_num_seqs, DEFAULT_MAX_CAPTURE_SIZE)
    return sorted({s for s in (1, 2, 4, *range(8, top + 1, 8)) if s <= top} | {top})


def decode_graphs_for(
    model: LlamaForCausalLM, kv_cache: KVCache, max_model_len: int, config: EngineConfig
) -> DecodeGraphs | None:
    """Captured decode for an engine on one CUDA device whose attention backend supports it; None (every
    step eager) otherwise or with ``enforce_eager``."""
    device = kv_cache.layers[0].key.device
    if config.enforce_eager or device.type != "cuda" or not model.backend.supports_captured_decode:
        return None
    return DecodeGraphs(
        model,
        kv_cache,
        capture_sizes(config.scheduler.max_num_seqs, config.cuda_graph_sizes),
        max_model_len,
        CudaGraphCapture(device),
    )


def _reserved_bytes(device: torch.device) -> int:
    """What the CUDA caching allocator holds on ``device`` (the graphs' pool included); 0 elsewhere."""
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


class GraphCapture(Protocol):
    """Records ``forward`` (which reads only the static inputs) and returns its replay and the tensor
    each replay refreshes."""

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]: ...


class CudaGraphCapture:
    """``torch.cuda.CUDAGraph`` capture on a side stream, every graph in one memory pool (captured
    largest first, the smaller ones reuse its blocks)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        # an eager run first: Triton compiles its kernels and cuBLAS makes its workspace outside capture
        forward()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        torch.cuda.synchronize(self.device)
        return graph.replay, out


@dataclass
class _Bucket:
    size: int
    meta: AttentionMetadata
    replay: Callable[[], None]
    #: the graph's output, ``[size, hidden]``, rewritten by each replay
    hidden: torch.Tensor


class DecodeGraphs:
    """Captured decode for one model and its KV cache, bucketed by batch size."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        sizes: Sequence[int],
        max_model_len: int,
        capture: GraphCapture,
    ) -> None:
        if not sizes:
            raise ValueError("decode graphs need at least one batch size")
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = sorted(sizes)
        self.capture_backend = capture
        self.block_size = kv_cache.block_size
        rows, width = self.sizes[-1], cdiv(max_model_len, self.block_size)
        device = kv_cache.layers[0].key.device
        # the padding state: one token at position 0 in slot 0 of the reserved block 0
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros_like(self.input_ids)
        self.slot_mapping = torch.zeros_like(self.input_ids)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        #: rows written by the last replay's sequences (the rows after them hold the padding state)
        self._live_rows = 0
        self._buckets: dict[int, _Bucket] = {}
        #: None until the first decode-only step captures; False once a capture has failed
        self.captured: bool | None = None
        #: decode steps served by a replay (a figure for logs and tests)
        self.replays = 0
        self.memory_bytes = 0

    def accepts(self, batch: StepBatch) -> bool:
        meta = batch.meta
        return (
            self.captured is not False
            and 0 < meta.num_seqs <= self.sizes[-1]
            and meta.num_decodes == meta.num_seqs == meta.num_tokens
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def run(self, batch: StepBatch) -> torch.Tensor | None:
        """The hidden states ``[n, hidden]`` of a decode-only batch of ``n`` sequences from a replay, or
        None when this batch runs eagerly (not decode-only, too large, or capture failed)."""
        if not self.accepts(batch):
            return None
        if self.captured is None:
            self.capture_all()
            if not self.captured:
                return None
        meta, n = batch.meta, batch.meta.num_seqs
        bucket = self._buckets[self.sizes[bisect.bisect_left(self.sizes, n)]]
        self._load(batch.input_ids, batch.positions, meta, n)
        bucket.replay()
        self.replays += 1
        return bucket.hidden[:n]

    def _load(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, n: int
    ) -> None:
        """The step's rows into the static inputs; rows a larger previous step left are reset to padding."""
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens[:n], non_blocking=True)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables[:n], non_blocking=True)
        # columns past ``width`` keep older ids: the kernels read only a sequence's own blocks
        if self._live_rows > n:
            stale = slice(n, self._live_rows)
            for buffer in (self.input_ids, self.positions, self.slot_mapping, self.block_tables):
                buffer[stale].zero_()
            self.seq_lens[stale].fill_(1)
        self._live_rows = n

    def capture_all(self) -> None:
        """Capture every bucket, largest first; on failure log why and leave the engine eager."""
        self._reset_rows()
        start, reserved = time.perf_counter(), _reserved_bytes(self.input_ids.device)
        try:
            for size in reversed(self.sizes):
                self._buckets[size] = self._capture(size)
        except Exception as err:
            self._buckets.clear()
            if self.input_ids.device.type == "cuda":
                torch.cuda.empty_cache()  # the pool of graphs captured before the failure goes back
            self.captured = False
            log.warning(
                "decode graphs off, decode steps run eagerly: capturing failed (%s: %s)",
                type(err).__name__,
                err,
            )
            return
        self.captured = True
        #: device memory the capture added (the graphs' pool; outside the KV budget, within the share
        #: ``gpu_memory_utilization`` leaves); 0 off CUDA
        self.memory_bytes = max(0, _reserved_bytes(self.input_ids.device) - reserved)
        log.info(
            "captured decode graphs for %d batch sizes (1..%d) in %.2f s, %.1f MiB of device memory",
            len(self.sizes),
            self.sizes[-1],
            time.perf_counter() - start,
            self.memory_bytes / 2**20,
        )

    def _reset_rows(self) -> None:
        for buffer in (self.input_ids, self.positions, self.slot_mapping, self.block_tables):
            buffer.zero_()
        self.seq_lens.fill_(1)
        self._live_rows = 0

    def _capture(self, size: int) -> _Bucket:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            num_decodes=size,
            query_lens_host=[1] * size,
            seq_lens_host=[1] * size,
            block_size=self.block_size,
            captured=True,
        )
        ids, positions, layers = self.input_ids[:size], self.positions[:size], self.kv_cache.layers

        def forward() -> torch.Tensor:
            meta.extras.clear()  # the backend prepares the captured plan on each run
            return self.model(ids, positions, layers, meta)

        replay, hidden = self.capture_backend.capture(forward)
        # ``meta`` keeps the plan's split scratch alive for as long as the graph replays into it
        return _Bucket(size, meta, replay, hidden)
