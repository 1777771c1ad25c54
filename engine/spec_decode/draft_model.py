"""The ``draft_model`` proposer (docs/architecture.md#speculative-decoding): a smaller model with the target's
tokenizer drafts ``k`` tokens per speculating sequence, one batched decode forward per draft position.

Its paged KV cache is its own tensors laid out over the target's blocks: the same block tables and slots,
so the KV manager, prefix cache and preemption need nothing new. The draft runs over every flat batch the
target computes (``observe``), so its cache holds what the target's does at the same slots; the positions a
proposal writes ahead are rewritten by the verification step's ``observe``. Where the draft's cache can be
stale — a block copied on write, a swap-in — only its proposals suffer, never the output: the target
checks every draft.

A sampled sequence draws its drafts from ``q = softmax(draft logits / T)`` (from its own generator when
seeded) and keeps ``q`` for the exact rule; a greedy one takes the draft's argmax.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.engine.engine_setup import load_served_model
from kvpilot.engine.input_batch import StepBatch
from kvpilot.engine.kv.block_table import BlockTableTensor
from kvpilot.engine.kv.kv_cache import KVCache
from kvpilot.engine.sampling.draw import inverse_cdf_draw, uniform_numbers
from kvpilot.engine.sampling.params import NEAR_ZERO_TEMPERATURE
from kvpilot.engine.sequence import Sequence

if TYPE_CHECKING:
    from kvpilot.engine.engine_core import LLMEngine


class DraftModel:
    def __init__(self, engine: LLMEngine, model: str) -> None:
        served = load_served_model(
            model,
            engine.config,
            engine.device,
            engine.dtype,
            engine.linear_backend,
            engine.native_ops,
            "auto",
        )
        self.device, self.dtype = engine.device, engine.dtype
        self.model_dir, self.arch, self.backend, self.model = (
            served.model_dir,
            served.arch,
            served.backend,
            served.model,
        )
        if self.arch.vocab_size != engine.arch.vocab_size:
            raise ValueError(
                f"speculative_config: the draft model {model!r} has a vocabulary of {self.arch.vocab_size} "
                f"tokens, the target {engine.arch.vocab_size}: a draft must share the target's tokenizer"
            )
        #: what the draft's cache costs per token (the engine sizes its blocks for both caches)
        self.kv_bytes_per_token = served.kv_bytes_per_token
        #: the draft's cache stores what the target's does (docs/architecture.md#kv-cache-dtype), with the
        #: draft checkpoint's own fp8 scales if it has them (``kv_bytes_per_token`` counts on the same)
        self.kv_cache_dtype = served.kv_cache_dtype
        self._fp8_scales = served.fp8_kv_scales()
        self.cache: KVCache | None = None

    def check_context(self, max_model_len: int) -> None:
        """The draft must reach every position the target serves."""
        if self.arch.max_position_embeddings < max_model_len:
            raise ValueError(
                f"speculative_config: the draft model serves {self.arch.max_position_embeddings} positions, "
                f"the engine {max_model_len}: lower --max-model-len or use a draft with a longer context"
            )

    def allocate_cache(self, num_blocks: int, block_size: int, layout: str) -> None:
        arch = self.arch
        self.cache = KVCache(
            arch.num_hidden_layers,
            num_blocks,
            block_size,
            arch.num_key_value_heads,
            arch.head_dim,
            self.dtype,
            self.device,
            layout=layout,
            kv_cache_dtype=self.kv_cache_dtype,
            fp8_scales=self._fp8_scales,
        )

    def observe(self, batch: StepBatch) -> None:
        """Run the draft over the target's flat batch, writing its K/V at the same slots."""
        assert self.cache is not None
        with torch.inference_mode():
            self.model(batch.input_ids, batch.positions, self.cache.layers, replace(batch.meta, extras={}))

    def propose(
        self,
        seqs: list[Sequence],
        limits: list[int],
        tables: BlockTableTensor,
        generators: list[torch.Generator | None],
        generator: torch.Generator,
    ) -> None:
        """Set ``spec_token_ids`` (and ``spec_draft_probs`` for sampled sequences) of each of ``seqs``,
        whose block tables already cover ``limits[i]`` tokens past their last one. ``tables``: the KV
        manager's ``BlockTableTensor``."""
        assert self.cache is not None
        k = max(limits)
        batch = len(seqs)
        dev, bs = self.device, self.cache.block_size
        slots = np.asarray([tables.slot_of[s.seq_id] for s in seqs], dtype=np.int64)
        start = np.asarray([s.num_tokens - 1 for s in seqs], dtype=np.int64)
        tables.commit()
        host = tables.host.numpy()
        width = int(max(tables.num_blocks[s] for s in slots))
        block_tables = tables.device_table[:, :width].index_select(0, torch.from_numpy(slots).to(dev))
        temps = torch.tensor([s.params.temperature for s in seqs], device=dev).clamp(
            min=NEAR_ZERO_TEMPERATURE
        )
        sampled = [not s.params.is_greedy for s in seqs]
        is_sampled = torch.tensor(sampled, device=dev)
        own = [gen if samples else None for gen, samples in zip(generators, sampled, strict=True)]
        tokens = torch.tensor([s.all_token_ids[-1] for s in seqs], dtype=torch.long, device=dev)
        vocab = self.arch.vocab_size
        drafts = torch.zeros((batch, k), dtype=torch.long, device=dev)
        probs = torch.zeros((batch, k, vocab), device=dev)
        lim = np.asarray(limits, dtype=np.int64)
        with torch.inference_mode():
            for j in range(k):
                # only the rows still drafting: a row past its limit has no slot for that position (its
                # table covers its own drafts only) and a seeded row draws for its own drafts only
                rows = np.flatnonzero(lim > j)
                rows_dev = torch.from_numpy(rows).to(dev)
                pos = start[rows] + j
                slot_mapping = host[slots[rows], pos // bs].astype(np.int64) * bs + pos % bs
                meta = AttentionMetadata(
                    slot_mapping=torch.from_numpy(slot_mapping).to(dev),
                    query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32, device=dev),
                    seq_lens=torch.from_numpy((pos + 1).astype(np.int32)).to(dev),
                    block_tables=block_tables.index_select(0, rows_dev),
                    num_decodes=len(rows),
                    query_lens_host=[1] * len(rows),
                    seq_lens_host=(pos + 1).tolist(),
                    block_size=bs,
                )
                hidden = self.model(tokens[rows_dev], torch.from_numpy(pos).to(dev), self.cache.layers, meta)
                logits = self.model.compute_logits(hidden).float()
                q = (logits / temps[rows_dev].unsqueeze(1)).softmax(dim=-1)
                step_tokens = logits.argmax(dim=-1)
                if any(sampled[i] for i in rows):
                    # drawn exactly from q (the rule divides by it): the sampler's own inverse CDF
                    u = uniform_numbers([own[i] for i in rows], 1, generator, dev)[:, 0]
                    step_tokens = torch.where(is_sampled[rows_dev], inverse_cdf_draw(q, u), step_tokens)
                tokens[rows_dev] = step_tokens
                drafts[rows_dev, j] = step_tokens
                probs[rows_dev, j] = q
        ids = drafts.tolist()
        for i, seq in enumerate(seqs):
            seq.spec_token_ids = ids[i][: limits[i]]
            seq.spec_draft_probs = probs[i, : limits[i]] if sampled[i] else None
