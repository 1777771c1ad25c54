"""A tensor-parallel rank's slice of GGUF blocks kept as stored (docs/architecture.md#tensor-parallelism).

GGUF blocks run along a row's input dimension, so the shards of
``distributed.sharding`` are byte slices of the stored rows: a column-parallel weight (q/k/v, gate/up, the
embedding and an untied LM head) keeps whole rows — the rank's heads, MLP columns or vocabulary rows, the
last vocabulary shard padded with zero rows (a zero scale dequantizes to zeros) — and a row-parallel one
(o_proj, down_proj) keeps the byte range of its input columns, which must start and end on a block
boundary (32 columns, 256 for the K-quants' super-blocks): a width that does not is refused naming the
format.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvpilot.engine.config import ConfigError
from kvpilot.engine.distributed.sharding import TensorShard
from kvpilot.engine.model.quant_formats import QuantWeight, concat_rows


def _rows(weight: QuantWeight, pick: Callable[[torch.Tensor], torch.Tensor]) -> QuantWeight:
    scales = None if weight.scales is None else pick(weight.scales).contiguous()
    return QuantWeight(weight.format, pick(weight.data).contiguous(), scales, weight.in_features)


def _part(weight: QuantWeight, start: int, stop: int) -> QuantWeight:
    return _rows(weight, lambda t: t[start:stop])


def _columns(weight: QuantWeight, start: int, width: int, path: str) -> QuantWeight:
    fmt = weight.format
    block = fmt.block_weights
    if not fmt.row_scales and (start % block or width % block):
        raise ConfigError(
            f"{path}: {fmt.name} blocks hold {block} input columns, and this rank's {width} columns from "
            f"{start} do not fall on block boundaries; use another tensor_parallel_size or "
            "quantization='none'"
        )
    first, last = fmt.row_bytes(start), fmt.row_bytes(start + width)
    return QuantWeight(fmt, weight.data[:, first:last].contiguous(), weight.scales, width)


def shard_quant_weight(path: str, weight: QuantWeight, shard: TensorShard) -> QuantWeight:
    """``shard``'s part of the quantized weight of module ``path`` (``layers.3.self_attn.qkv_proj``,
    ``embed_tokens``)."""
    arch = shard.arch
    d = arch.head_dim
    if path.endswith("qkv_proj"):
        q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
        return concat_rows(
            [
                _rows(_part(weight, 0, q), shard.q_rows),
                _rows(_part(weight, q, q + kv), shard.kv_rows),
                _rows(_part(weight, q + kv, q + 2 * kv), shard.kv_rows),
            ]
        )
    if path.endswith("gate_up_proj"):
        half = arch.intermediate_size
        return concat_rows(
            [
                _rows(_part(weight, 0, half), shard.mlp_rows),
                _rows(_part(weight, half, 2 * half), shard.mlp_rows),
            ]
        )
    if path.endswith("o_proj"):
        width = shard.num_heads * d
        return _columns(weight, shard.rank * width, width, path)
    if path.endswith("down_proj"):
        return _columns(weight, shard.rank * shard.intermediate, shard.intermediate, path)
    if path in ("embed_tokens", "lm_head"):
        return _rows(weight, shard.vocab_slice)
    raise ValueError(f"no tensor-parallel slicing for quantized module {path!r}")


def shard_quant_weights(weights: dict[str, QuantWeight], shard: TensorShard) -> dict[str, QuantWeight]:
    return {path: shard_quant_weight(path, w, shard) for path, w in weights.items()}
