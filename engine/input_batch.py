"""The persistent batch: per-slot token ids and sampling parameters kept across steps, and each step's flat
inputs built from them (docs/architecture.md#persistent-batch).

A slot is a row of the KV manager's ``BlockTableTensor``: a sequence holds one while it holds device blocks
(from its first allocation, fork or swap-in until it finishes, is preempted or swapped out). Beside the
block tables the batch keeps, per slot:

- the sequence's token ids (host, ``[capacity, max_model_len]`` int32), written incrementally: the whole
  known sequence when a sequence takes the slot, then only the tokens appended since (one per decode);
- its sampling parameters (``row_params.COLUMNS``), written once when it takes the slot, on the device.

A slot's row is brought up to date when its sequence is next used (``sync``): the slot's owner is compared
by identity, so a slot reused by another sequence is rewritten, and a sequence that gets its old slot back
after a preemption keeps its tokens (a sequence's tokens only ever grow). The owner is held by a weak
reference: a slot must not keep an ended request (its prompt ids, its detokenizer) alive until the slot is
taken again.

``build`` turns a scheduler tick into the flat batch with array operations over the scheduled sequences —
token ids and slots gathered from the per-slot tables at each token's position, block tables as a gather of
rows (a view when the batch is slots 0..B-1 in order) — and uploads the index arrays in two non-blocking
copies from pinned staging buffers (``engine/staging.py``). Under asynchronous scheduling a sequence's
newest token may still be on the device (``Sequence.pending_row``): its input is copied there from the last
step's sampled ids, so building the step never waits for them (docs/architecture.md#asynchronous-scheduling).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.engine.kv.block_table import BlockTableTensor
from kvpilot.engine.sampling.row_params import COLUMNS, SamplingTensors, param_row
from kvpilot.engine.sequence import Sequence
from kvpilot.engine.staging import Staging


@dataclass
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    #: flat-batch rows whose logits are computed: the last new token of each sequence that samples this
    #: step (and each of its draft tokens when it speculates), then the prompt positions of sequences that
    #: asked for prompt logprobs
    logits_indices: torch.Tensor
    sampling_sequences: list[Sequence]
    #: (request, first logits row, number of rows, prompt position of the first row) per prompt-logprob span
    prompt_spans: list[tuple[Sequence, int, int, int]]
    #: logits rows of each sampling request, in order: 1, or 1 + its drafts when it speculates
    sample_row_counts: list[int]


class InputBatch:
    def __init__(self, blocks: BlockTableTensor, max_model_len: int, block_size: int, device: torch.device):
        self.blocks = blocks
        self.block_size = block_size
        self.device = device
        cap = blocks.capacity
        # np.zeros maps pages lazily: only the rows and lengths sequences reach are ever touched
        self.token_ids = np.zeros((cap, max_model_len), dtype=np.int32)
        #: tokens of the owner already in its slot's row
        self.num_written = [0] * cap
        #: the sequence each slot's rows were written for (weakly: see the module docstring)
        self.owner: list[weakref.ref[Sequence] | None] = [None] * cap
        self.params = np.zeros((cap, len(COLUMNS)), dtype=np.float32)
        self._params_device = torch.from_numpy(self.params) if device.type == "cpu" else None
        self._ints = Staging(device, torch.int64)
        self._int32s = Staging(device, torch.int32)
        self._row_slots = Staging(device, torch.int64)
        self._param_staging = Staging(device, torch.float32)

    def _grow(self, capacity: int, width: int) -> None:
        tokens = np.zeros((capacity, width), dtype=np.int32)
        tokens[: self.token_ids.shape[0], : self.token_ids.shape[1]] = self.token_ids
        params = np.zeros((capacity, len(COLUMNS)), dtype=np.float32)
        params[: self.params.shape[0]] = self.params
        extra = capacity - len(self.owner)
        self.token_ids, self.params = tokens, params
        self.num_written.extend([0] * extra)
        self.owner.extend([None] * extra)
        self._params_device = torch.from_numpy(self.params) if self.device.type == "cpu" else None

    def sync(self, req: Sequence) -> int:
        """The slot of ``req`` (which holds a block table), with its rows brought up to date."""
        slot = self.blocks.slot_of[req.seq_id]
        num_tokens = req.num_tokens
        width = num_tokens + req.num_pending + len(req.spec_token_ids)
        if slot >= len(self.owner) or width > self.token_ids.shape[1]:
            self._grow(max(self.blocks.capacity, len(self.owner)), max(width, self.token_ids.shape[1]))
        if self._owner(slot) is not req:
            self.owner[slot] = weakref.ref(req)
            self.num_written[slot] = 0
            self.params[slot] = param_row(req.params)
            if self.device.type != "cpu":
                self._params_device = None  # upload the table again before the next gather
        written = self.num_written[slot]
        if num_tokens > written:
            self.token_ids[slot, written:num_tokens] = req.all_token_ids[written:num_tokens]
            self.num_written[slot] = num_tokens
        return slot

    def _owner(self, slot: int) -> Sequence | None:
        ref = self.owner[slot] if slot < len(self.owner) else None
        return ref() if ref is not None else None

    # ---- one step ------------------------------------------------------------------------------------
    def build(
        self, scheduled: list[tuple[Sequence, int]], in_flight: torch.Tensor | None = None
    ) -> StepBatch:
        """``scheduled`` in batch order (one-token sequences first), every one holding a block table.
        ``in_flight``: the last step's sampled ids, on the device, where a sequence's token that is not
        known on the host yet (``Sequence.pending_row``, asynchronous scheduling) is taken from."""
        slots: list[int] = []
        starts, seq_lens, query_lens = [0], [], []
        logits_rows: list[int] = []
        sampling: list[Sequence] = []
        prompt_rows: list[int] = []
        prompt_spans: list[tuple[Sequence, int, int, int]] = []
        num_decodes = 0
        row_counts: list[int] = []
        pending_rows: list[int] = []  # (flat-batch row, row in ``in_flight``) of tokens taken on the device
        for req, n in scheduled:
            slot = self.sync(req)
            slots.append(slot)
            c = req.num_computed_tokens
            drafts = req.spec_token_ids
            if drafts:
                # scored after the last token; past ``num_written``, so the accepted ones are rewritten
                # from the sequence's tokens at its next sync and the rejected ones never read
                self.token_ids[slot, req.num_tokens : req.num_tokens + len(drafts)] = drafts
            starts.append(starts[-1] + n)
            seq_lens.append(c + n)
            query_lens.append(n)
            if n == 1 and len(query_lens) == num_decodes + 1:
                num_decodes += 1
            if req.pending_row is not None and c <= req.num_tokens < c + n:
                pending_rows += (starts[-2] + req.num_tokens - c, req.pending_row)
            if c + n >= req.num_tokens_ahead:
                # a speculating sequence is scored at its last token and after each draft
                first = starts[-1] - 1 - len(drafts)
                logits_rows.extend(range(first, starts[-1]))
                row_counts.append(1 + len(drafts))
                sampling.append(req)
            if req.params.prompt_logprobs is not None and req.num_output_tokens == 0:
                # position p's logits score prompt token p + 1; the last prompt position samples instead
                last = min(c + n, req.num_prompt_tokens - 1)
                if last > c:
                    prompt_spans.append((req, len(prompt_rows), last - c, c))
                    prompt_rows.extend(range(starts[-2], starts[-2] + last - c))
        num_seqs, num_tokens = len(scheduled), starts[-1]
        slot_arr = np.asarray(slots, dtype=np.int64)
        lens = np.asarray(seq_lens, dtype=np.int64)
        if num_tokens == num_seqs:  # decodes only: one token per sequence, at its last position
            token_slot, positions = slot_arr, lens - 1
        else:
            qlens = np.asarray(query_lens, dtype=np.int64)
            # token t of sequence b sits at (context of b) + (t - start of b)
            shift = np.asarray(starts[:-1], dtype=np.int64) - (lens - qlens)
            token_slot = np.repeat(slot_arr, qlens)
            positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(shift, qlens)
        bs = self.block_size
        tables = self.blocks.host.numpy()
        slot_mapping = tables[token_slot, positions // bs].astype(np.int64) * bs + positions % bs
        self.blocks.commit()
        input_ids, pos, slot_map, logits_idx, slot_dev, pending = self._ints.upload(
            self.token_ids[token_slot, positions].astype(np.int64),
            positions,
            slot_mapping,
            np.asarray(logits_rows + prompt_rows, dtype=np.int64),
            slot_arr,
            np.asarray(pending_rows, dtype=np.int64),
        )
        if pending_rows:
            assert in_flight is not None, "a sequence has a token in flight but no step's ids were given"
            pairs = pending.view(-1, 2)
            # a row that got NO_TOKEN (its constraints left none) computes from token 0, a row dropped once
            # the host reads that its sequence ended
            input_ids.index_copy_(0, pairs[:, 0], in_flight.index_select(0, pairs[:, 1]).clamp_(min=0))
        qsl, lens_dev = self._int32s.upload(np.asarray(starts, dtype=np.int32), lens.astype(np.int32))
        width = max(self.blocks.num_blocks[s] for s in slots)
        table = self.blocks.device_table[:, :width]
        # slots 0..B-1 in batch order (a steady decode batch): the rows as they are, no copy
        block_tables = table[:num_seqs] if slots == list(range(num_seqs)) else table.index_select(0, slot_dev)
        meta = AttentionMetadata(
            slot_mapping=slot_map,
            query_start_loc=qsl,
            seq_lens=lens_dev,
            block_tables=block_tables,
            num_decodes=num_decodes,
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
            block_size=bs,
        )
        prompt_spans = [(r, len(logits_rows) + off, cnt, p) for r, off, cnt, p in prompt_spans]
        return StepBatch(input_ids, pos, meta, logits_idx, sampling, prompt_spans, row_counts)

    def sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        """The sampling parameters of ``seqs`` (each holding a block table; forks included) as tensors."""
        slots = np.asarray([self.sync(s) for s in seqs], dtype=np.int64)
        if self._params_device is None:  # a slot changed owner since the last upload
            (flat,) = self._param_staging.upload(self.params.reshape(-1))
            self._params_device = flat.view(self.params.shape)
        (index,) = self._row_slots.upload(slots)
        return SamplingTensors(self._params_device.index_select(0, index))

    # ---- checking ------------------------------------------------------------------------------------
    def check(self) -> None:
        """Every slot row written for a sequence that still holds it equals that sequence's state (run by
        ``LLMEngine.check_invariants``)."""
        for seq_id, slot in self.blocks.slot_of.items():
            req = self._owner(slot)
            if req is None or req.seq_id != seq_id:
                continue  # not used since it took the slot: written at its next use
            written = self.num_written[slot]
            assert written <= req.num_tokens, f"{seq_id}: {written} tokens written, it has {req.num_tokens}"
            assert self.token_ids[slot, :written].tolist() == req.all_token_ids[:written], (
                f"{seq_id}: its slot's token ids differ from its tokens"
            )
            assert self.params[slot].tolist() == np.asarray(param_row(req.params), np.float32).tolist(), (
                f"{seq_id}: its slot's sampling parameters differ from its own"
            )
