"""The tensor-parallel layers a rank's model runs (docs/architecture.md#tensor-parallelism).

A rank's model is the ordinary ``LlamaForCausalLM`` built from ``TensorShard.local_arch()``: its fused
q/k/v and gate/up projections already are the column-parallel shards (local heads, local MLP columns),
and attention runs on the rank's heads alone. Three things make the shards one model again, installed on
the loaded model by ``install_tensor_parallel``:

- ``RowParallel`` around ``o_proj`` and ``down_proj``: the rank's partial product, then an all-reduce —
  two per decoder layer, each ``[tokens, hidden]``;
- ``VocabParallelEmbedding``: each rank looks up the ids in its vocabulary rows (zeros elsewhere), then an
  all-reduce;
- the logits gather: each rank's LM head gives its ``Vp`` columns; rank 0 gathers them and cuts the
  padding, so the sampler sees the full vocabulary (the other ranks get no rows).

``RowParallel`` wraps its linear as a child, so a later pass that replaces linears (oneDNN packing) packs
the shard inside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kvpilot.engine.distributed.groups import TensorParallelGroup
from kvpilot.engine.distributed.sharding import TensorShard
from kvpilot.engine.model.layers import MLP

if TYPE_CHECKING:
    from kvpilot.engine.model.llama import LlamaForCausalLM


class RowParallel(nn.Module):
    """``linear`` over this rank's input columns, summed over the ranks."""

    def __init__(self, linear: nn.Module, group: TensorParallelGroup) -> None:
        super().__init__()
        self.linear = linear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.linear(x))


class VocabParallelEmbedding(nn.Module):
    """The embedding rows ``[first, first + rows)`` of the vocabulary on this rank (``lookup``: a float
    ``nn.Embedding`` or the GGUF blocks' ``QuantEmbedding``), summed over ranks."""

    def __init__(self, lookup: nn.Module, first: int, rows: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.lookup = lookup
        self.first, self.rows = first, rows
        self.group = group

    @property
    def weight(self) -> torch.Tensor:
        """The float rows (a tied LM head's weight; a quantized lookup has its own head)."""
        weight = self.lookup.weight
        assert isinstance(weight, torch.Tensor), "a quantized embedding has no float rows"
        return weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.rows)
        out = self.lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(out)


class LogitsGather:
    """Rank 0: the full ``[rows, vocab]`` logits from every rank's columns; other ranks: no rows."""

    def __init__(self, group: TensorParallelGroup, vocab_size: int) -> None:
        self.group, self.vocab_size = group, vocab_size

    def __call__(self, local: torch.Tensor) -> torch.Tensor:
        full = self.group.gather_columns(local)
        return local.new_empty((0, self.vocab_size)) if full is None else full[:, : self.vocab_size]


def install_tensor_parallel(model: LlamaForCausalLM, shard: TensorShard, group: TensorParallelGroup) -> None:
    """Make the loaded shard ``model`` (a ``LlamaForCausalLM`` of ``shard.local_arch()``) one rank of the
    whole: all-reduces after the row-parallel projections and the embedding, a gather after the LM head."""
    for layer in model.decoder_layers:
        mlp = layer.mlp
        assert isinstance(mlp, MLP), "Mixture-of-Experts models are not split (check_tensor_parallel)"
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group)
        mlp.down_proj = RowParallel(mlp.down_proj, group)
    model.embed_tokens = VocabParallelEmbedding(
        model.embed_tokens, shard.rank * shard.vocab_rows, shard.vocab_rows, group
    )
    model.logits_gather = LogitsGather(group, shard.arch.vocab_size)
