"""Which part of the model each tensor-parallel rank holds, and its shard of the full checkpoint
(docs/architecture.md#tensor-parallelism).

Rank ``r`` of ``size`` holds query heads ``[r·H/size, (r+1)·H/size)``, the KV heads those query heads
read (a contiguous ``KV/size`` of them, or — when ``size`` exceeds the KV heads — the one head its queries
share, replicated on ``size/KV`` ranks), MLP columns ``[r·I/size, (r+1)·I/size)`` and vocabulary rows
``[r·Vp, (r+1)·Vp)`` with ``Vp = ceil(V/size)`` (the last shard padded with zero rows, whose logits are cut
after the gather). Column-parallel weights (q/k/v, gate/up, embedding, LM head) are sliced by output rows,
row-parallel ones (o_proj, down_proj) by input columns; a row-parallel bias is kept by rank 0 only, since
the all-reduce adds every rank's output.

``ShardedCheckpoint`` presents the full checkpoint under its own names with each tensor already sliced, so
``weights.load_hf_weights`` fills the rank's smaller model unchanged; every rank reads the full tensors
and keeps only its slice.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

import torch

from kvpilot.engine.config import ConfigError
from kvpilot.engine.distributed.groups import TensorParallelGroup
from kvpilot.engine.model.arch import ModelArchConfig

#: quantization formats whose stored layout the shards do not slice yet, with what would be needed
_UNSHARDED_FORMATS = {
    "fp8": "fp8 weights (block-scaled e4m3) are not sliced per rank yet; use quantization='none' (an fp8 "
    "checkpoint loads dequantized) or tensor_parallel_size=1",
    "int8": "int8 weights are quantized after the load and their layers do not take shards yet; use "
    "quantization='none' or tensor_parallel_size=1",
}


def check_tensor_parallel(arch: ModelArchConfig, size: int, quantization: str) -> None:
    """Raise ``ConfigError`` when ``arch`` cannot be split over ``size`` ranks as ``quantization``."""
    if size == 1:
        return
    heads, kv = arch.num_attention_heads, arch.num_key_value_heads
    if heads % size:
        raise ConfigError(
            f"tensor_parallel_size={size} must divide the model's {heads} attention heads "
            f"(divisors: {[d for d in range(1, heads + 1) if heads % d == 0]})"
        )
    if kv % size and size % kv:
        raise ConfigError(
            f"tensor_parallel_size={size} must divide the model's {kv} KV heads or be a multiple of them "
            "(KV heads are split, or replicated when there are fewer than ranks)"
        )
    if arch.intermediate_size % size:
        raise ConfigError(
            f"tensor_parallel_size={size} must divide the model's MLP width (intermediate_size "
            f"{arch.intermediate_size})"
        )
    if arch.moe is not None:
        raise ConfigError(
            f"tensor_parallel_size={size}: Mixture-of-Experts models ({arch.model_type}) are not split "
            "across ranks yet (their experts would need expert or per-expert tensor parallelism); use 1"
        )
    if quantization in _UNSHARDED_FORMATS:
        raise ConfigError(
            f"tensor_parallel_size={size} with quantization {quantization!r}: "
            f"{_UNSHARDED_FORMATS[quantization]}"
        )


@dataclass(frozen=True)
class TensorShard:
    """Rank ``rank`` of ``size``'s part of a model with architecture ``arch`` (the full one)."""

    arch: ModelArchConfig
    rank: int
    size: int

    @property
    def num_heads(self) -> int:
        return self.arch.num_attention_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.arch.num_key_value_heads // self.size)

    @property
    def first_kv_head(self) -> int:
        kv = self.arch.num_key_value_heads
        return self.rank * kv // self.size if self.size <= kv else self.rank // (self.size // kv)

    @property
    def vocab_rows(self) -> int:
        """``Vp``: vocabulary rows per rank (the last rank's shard padded to it)."""
        return -(-self.arch.vocab_size // self.size)

    @property
    def intermediate(self) -> int:
        return self.arch.intermediate_size // self.size

    def local_arch(self) -> ModelArchConfig:
        """The architecture of this rank's part: the model class builds the shard's shapes from it."""
        return replace(
            self.arch,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate,
            vocab_size=self.vocab_rows,
        )

    # ---- slicing -----------------------------------------------------------------------------------
    def q_rows(self, t: torch.Tensor) -> torch.Tensor:
        d = self.arch.head_dim
        return t[self.rank * self.num_heads * d : (self.rank + 1) * self.num_heads * d]

    def kv_rows(self, t: torch.Tensor) -> torch.Tensor:
        d = self.arch.head_dim
        return t[self.first_kv_head * d : (self.first_kv_head + self.num_kv_heads) * d]

    def mlp_rows(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.rank * self.intermediate : (self.rank + 1) * self.intermediate]

    def vocab_slice(self, t: torch.Tensor) -> torch.Tensor:
        rows = t[self.rank * self.vocab_rows : (self.rank + 1) * self.vocab_rows]
        if rows.shape[0] == self.vocab_rows:
            return rows
        pad = torch.zeros(self.vocab_rows - rows.shape[0], *rows.shape[1:], dtype=rows.dtype)
        return torch.cat([rows, pad])

    def columns(self, t: torch.Tensor, width: int) -> torch.Tensor:
        """Input columns ``[rank·width, (rank+1)·width)`` of a row-parallel weight."""
        return t[..., self.rank * width : (self.rank + 1) * width].contiguous()

    def slice(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name`` (HF names, after any text-model renaming)."""
        arch = self.arch
        leaf = name.rsplit(".", 2)
        proj = leaf[-2] if len(leaf) >= 2 else ""
        q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
        if name.endswith("embed_tokens.weight") or name.endswith("lm_head.weight"):
            return self.vocab_slice(t)
        if proj == "q_proj":
            return self.q_rows(t)
        if proj in ("k_proj", "v_proj"):
            return self.kv_rows(t)
        if proj == "qkv_proj":  # Phi-3's fused q, k, v rows
            return torch.cat([self.q_rows(t[:q]), self.kv_rows(t[q : q + kv]), self.kv_rows(t[q + kv :])])
        if proj in ("gate_proj", "up_proj"):
            return self.mlp_rows(t)
        if proj == "gate_up_proj":  # Phi-3's fused gate, up rows
            half = arch.intermediate_size
            return torch.cat([self.mlp_rows(t[:half]), self.mlp_rows(t[half:])])
        if proj in ("o_proj", "down_proj"):
            if name.endswith(".bias"):  # added once, after the all-reduce sums the ranks' outputs
                return t if self.rank == 0 else torch.zeros_like(t)
            return self.columns(t, self.num_heads * arch.head_dim if proj == "o_proj" else self.intermediate)
        return t  # norms: replicated


@dataclass(frozen=True)
class TensorParallelRank:
    """What a rank's model load needs: its shard and the groups its layers' collectives run over."""

    shard: TensorShard
    group: TensorParallelGroup


class ShardedCheckpoint(Mapping[str, torch.Tensor]):
    """``tensors`` (a full checkpoint) with each tensor read as ``shard``'s slice of it."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], shard: TensorShard) -> None:
        self._tensors, self._shard = tensors, shard

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._shard.slice(name, self._tensors[name])

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)
