"""Turns a scheduler tick into one flattened forward pass and returns the logits of the rows to sample.

The flat batch comes from the persistent batch (``engine/input_batch.py``,
docs/architecture.md#persistent-batch): per-slot tensors kept across steps, not rebuilt from lists. On CUDA
a decode-only step replays a captured graph of the forward when ``decode_graphs`` holds one for its batch
size (``engine/decode_graphs.py``).
"""

from __future__ import annotations

import torch

from kvpilot.engine.decode_graphs import DecodeGraphs
from kvpilot.engine.input_batch import InputBatch, StepBatch
from kvpilot.engine.kv.kv_cache import KVCache
from kvpilot.engine.model.llama import LlamaForCausalLM
from kvpilot.engine.sequence import Sequence

__all__ = ["ModelRunner", "StepBatch"]


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device, input_batch: InputBatch
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = device
        self.input_batch = input_batch
        #: columns of the logits (a tensor-parallel rank's model holds a shard of them)
        self.vocab_size = model.arch.vocab_size
        #: captured decode (``engine/decode_graphs.py``); None = every step eager
        self.decode_graphs: DecodeGraphs | None = None

    def build_batch(
        self, scheduled: list[tuple[Sequence, int]], in_flight: torch.Tensor | None = None
    ) -> StepBatch:
        """``scheduled`` in batch order (one-token sequences first), each holding its block table;
        ``in_flight``: the last step's sampled ids on the device (asynchronous scheduling)."""
        return self.input_batch.build(scheduled, in_flight)

    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Run the forward pass; float32 logits for ``batch.logits_indices`` (sampling rows first)."""
        graphs = self.decode_graphs
        hidden = graphs.run(batch) if graphs is not None else None
        if hidden is None:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_cache.layers, batch.meta)
        if not batch.logits_indices.numel():
            return hidden.new_empty((0, self.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden.index_select(0, batch.logits_indices))
