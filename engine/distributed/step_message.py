"""What rank 0 broadcasts to the workers: each step's flat model inputs and the KV block operations the
scheduler ran since the last step (docs/architecture.md#tensor-parallelism).

One broadcast per step, whatever the number of layers: a fixed ``[MESSAGE_LEN]`` int64 message, the
``HEADER_LEN`` header (the command and the sizes) followed by the first ``INLINE_LEN`` words of the
payload; only a payload longer than that (a large prefill batch) sends its rest in a second broadcast.
The payload holds, in order, the input ids, positions and slot mapping (``[tokens]`` each), the logits
rows, ``query_start_loc`` and ``seq_lens``, the block tables (``[seqs, width]``, row-major) and the KV
operations. Each KV operation is ``kind, n, src × n, dst × n``:
a block copy (copy-on-write), a swap-out to host blocks or a swap-in from them, in the order rank 0 ran
them — a block freed by a swap-out may be the destination of a later copy in the same step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from kvpilot.engine.attention.metadata import AttentionMetadata

HEADER_LEN = 8
#: payload words carried in the message itself: a decode step of 64 sequences with tables of 40 blocks
#: fits (32 KiB per broadcast)
INLINE_LEN = 4088
MESSAGE_LEN = HEADER_LEN + INLINE_LEN
#: header commands
STEP, STOP, ALLOCATE = 1, 2, 3
#: KV operation kinds
COPY, SWAP_OUT, SWAP_IN = 0, 1, 2


@dataclass
class KVOp:
    """One batched block operation: ``src[i]`` → ``dst[i]`` (device/host block ids as ``kind`` says)."""

    kind: int
    src: list[int]
    dst: list[int]


@dataclass
class StepInputs:
    """The flat tensors of one forward step, as every rank runs it (CPU or the rank's device)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    kv_ops: list[KVOp] = field(default_factory=list)

    def metadata(self, block_size: int) -> AttentionMetadata:
        seq_lens = self.seq_lens.tolist()
        starts = self.query_start_loc.tolist()
        return AttentionMetadata(
            slot_mapping=self.slot_mapping,
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            num_decodes=self.num_decodes,
            query_lens_host=[b - a for a, b in itertools.pairwise(starts)],
            seq_lens_host=seq_lens,
            block_size=block_size,
        )

    def to(self, device: torch.device) -> StepInputs:
        """The tensors on ``device`` (a worker's GPU); the int32 ones stay int32."""
        return StepInputs(
            input_ids=self.input_ids.to(device),
            positions=self.positions.to(device),
            slot_mapping=self.slot_mapping.to(device),
            logits_indices=self.logits_indices.to(device),
            query_start_loc=self.query_start_loc.to(device),
            seq_lens=self.seq_lens.to(device),
            block_tables=self.block_tables.to(device),
            num_decodes=self.num_decodes,
            kv_ops=self.kv_ops,
        )


def encode_step(inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(message, the payload's rest beyond the message or None), int64 CPU tensors."""
    ops: list[int] = []
    for op in inputs.kv_ops:
        ops += [op.kind, len(op.src), *op.src, *op.dst]
    parts = [
        inputs.input_ids,
        inputs.positions,
        inputs.slot_mapping,
        inputs.logits_indices,
        inputs.query_start_loc,
        inputs.seq_lens,
        inputs.block_tables.reshape(-1),
        torch.tensor(ops, dtype=torch.int64),
    ]
    payload = torch.cat([p.cpu().to(torch.int64) for p in parts])
    seqs, width = inputs.block_tables.shape
    message = torch.zeros(MESSAGE_LEN, dtype=torch.int64)
    message[:HEADER_LEN] = torch.tensor(
        [
            STEP,
            payload.numel(),
            inputs.input_ids.numel(),
            seqs,
            width,
            inputs.logits_indices.numel(),
            inputs.num_decodes,
            len(ops),
        ],
        dtype=torch.int64,
    )
    inline = min(payload.numel(), INLINE_LEN)
    message[HEADER_LEN : HEADER_LEN + inline] = payload[:inline]
    return message, (payload[INLINE_LEN:] if payload.numel() > INLINE_LEN else None)


def payload_length(message: torch.Tensor) -> int:
    return int(message[1])


def decode_step(message: torch.Tensor, rest: torch.Tensor | None) -> StepInputs:
    """The step ``encode_step`` made ``(message, rest)`` of (CPU tensors)."""
    _, length, tokens, seqs, width, logits, num_decodes, num_ops = message[:HEADER_LEN].tolist()
    # a copy: the worker receives the next message into the same buffer
    payload = message[HEADER_LEN : HEADER_LEN + min(length, INLINE_LEN)].clone()
    if rest is not None:
        payload = torch.cat([payload, rest])
    sizes = [tokens, tokens, tokens, logits, seqs + 1, seqs, seqs * width, num_ops]
    ids, pos, slots, rows, qsl, lens, tables, ops = payload.split(sizes)
    return StepInputs(
        ids,
        pos,
        slots,
        rows,
        qsl.to(torch.int32),
        lens.to(torch.int32),
        tables.to(torch.int32).view(seqs, width),
        num_decodes,
        _decode_ops(ops.tolist()),
    )


def _decode_ops(flat: list[int]) -> list[KVOp]:
    out, i = [], 0
    while i < len(flat):
        kind, n = flat[i], flat[i + 1]
        out.append(KVOp(kind, flat[i + 2 : i + 2 + n], flat[i + 2 + n : i + 2 + 2 * n]))
        i += 2 + 2 * n
    return out


def control_message(command: int, *values: int) -> torch.Tensor:
    """A message without payload (``STOP``; ``ALLOCATE`` with the KV cache's sizes)."""
    message = torch.zeros(MESSAGE_LEN, dtype=torch.int64)
    message[0] = command
    message[2 : 2 + len(values)] = torch.tensor(values, dtype=torch.int64)
    return message
