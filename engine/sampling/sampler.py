"""Batched logits → token sampling.

Greedy rows take the argmax (ties → lowest token id, the first maximum). Other rows are scaled by 1/T,
filtered by top-k (ties broken by lower token id via a stable sort) and top-p (the smallest prefix whose
mass reaches p; the boundary token stays), then sampled by the exponential race ``argmax(p / E)``,
E ~ Exp(1), which draws exactly from p. Each seeded request draws its noise from its own generator, so
its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpilot.engine.sampling.params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k, then outside its top-p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # exclusive prefix sum
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        #: draws noise for requests without their own seed
        self.generator = generator

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        """One token id per row of ``logits`` [N, V] (float32)."""
        greedy = torch.tensor([p.is_greedy for p in params], device=logits.device)
        if bool(greedy.all()):
            return logits.argmax(dim=-1)
        temps = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params],
                             device=logits.device, dtype=logits.dtype)
        scaled = logits / temps.unsqueeze(1)
        vocab = logits.shape[-1]
        top_k = top_p = None
        if any(0 < p.top_k < vocab for p in params):
            top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=logits.device)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=logits.device, dtype=logits.dtype)
        if top_k is not None or top_p is not None:
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)
