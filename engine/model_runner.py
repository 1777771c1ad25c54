"""Turns a scheduler tick into one flattened forward pass and returns the logits of the rows to sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.engine.kv.kv_cache import KVCache
from kvpilot.engine.model.llama import LlamaForCausalLM
from kvpilot.engine.request import Request


@dataclass
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    #: flat-batch rows whose logits are computed: the last new token of each sequence that samples this
    #: step, then the prompt positions of sequences that asked for prompt logprobs
    logits_indices: torch.Tensor
    sampling_requests: list[Request]
    #: (request, first logits row, number of rows, prompt position of the first row) per prompt-logprob span
    prompt_spans: list[tuple[Request, int, int, int]]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = device

    def build_batch(self, scheduled: list[tuple[Request, int]], tables: list[list[int]]) -> StepBatch:
        """``scheduled`` in batch order (one-token sequences first); ``tables[i]`` is its block table."""
        ids: list[int] = []
        starts, seq_lens, query_lens = [0], [], []
        logits_rows: list[int] = []
        sampling: list[Request] = []
        prompt_rows: list[int] = []
        prompt_spans: list[tuple[Request, int, int, int]] = []
        num_decodes = 0
        for req, n in scheduled:
            c = req.num_computed_tokens
            ids.extend(req.all_token_ids[c : c + n])
            starts.append(starts[-1] + n)
            seq_lens.append(c + n)
            query_lens.append(n)
            if n == 1 and len(query_lens) == num_decodes + 1:
                num_decodes += 1
            if c + n >= req.num_tokens:
                logits_rows.append(starts[-1] - 1)
                sampling.append(req)
            if req.params.prompt_logprobs is not None and req.num_output_tokens == 0:
                # position p's logits score prompt token p + 1; the last prompt position samples instead
                last = min(c + n, req.num_prompt_tokens - 1)
                if last > c:
                    prompt_spans.append((req, len(prompt_rows), last - c, c))
                    prompt_rows.extend(range(starts[-2], starts[-2] + last - c))
        dev = self.device
        width = max(len(t) for t in tables)
        block_tables = torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev
        )
        qsl = torch.tensor(starts, dtype=torch.int32, device=dev)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        # per-token positions and slots with tensor ops (no Python loop over prompt tokens)
        qlens = torch.tensor(query_lens, device=dev)
        seq_of_token = torch.repeat_interleave(torch.arange(len(scheduled), device=dev), qlens)
        offset_in_seq = torch.arange(len(ids), device=dev) - qsl[:-1].long()[seq_of_token]
        positions = (lens.long() - qlens)[seq_of_token] + offset_in_seq
        blocks = block_tables[seq_of_token, positions // self.block_size].long()
        slot_mapping = blocks * self.block_size + positions % self.block_size
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=qsl,
            seq_lens=lens,
            block_tables=block_tables,
            num_decodes=num_decodes,
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
            block_size=self.block_size,
        )
        prompt_spans = [(r, len(logits_rows) + off, cnt, pos) for r, off, cnt, pos in prompt_spans]
        return StepBatch(
            torch.tensor(ids, dtype=torch.long, device=dev),
            positions,
            meta,
            torch.tensor(logits_rows + prompt_rows, dtype=torch.long, device=dev),
            sampling,
            prompt_spans,
        )

    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Run the forward pass; float32 logits for ``batch.logits_indices`` (sampling rows first)."""
        hidden = self.model(batch.input_ids, batch.positions, self.kv_cache.layers, batch.meta)
        if not batch.logits_indices.numel():
            return hidden.new_empty((0, self.model.arch.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden.index_select(0, batch.logits_indices))
