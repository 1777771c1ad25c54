"""One token per row drawn from a probability matrix by inverse CDF, with one uniform number per row.

The exponential race (``argmax p_i / E_i``) needs a random number per vocabulary entry: at 128 rows of a
50k vocabulary that is the sampler's largest cost on a CPU. Inverse CDF needs one per row, but a float32
prefix sum over 50k entries loses the small probabilities to rounding. So the CDF has two levels: chunks of
``CHUNK`` entries are summed in float32 (each sum is small, so its rounding is too), the chunk totals are
accumulated in float64, and only the chosen chunk's entries get a float64 prefix sum. Entries of
probability 0 have empty intervals and are never drawn. (``bench/results/step_profile.md``: timings.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

CHUNK = 256


def _last_positive(weights: torch.Tensor) -> torch.Tensor:
    """Per row, the index of the last entry > 0 (the fallback when rounding puts a draw past the end)."""
    positions = torch.arange(weights.shape[-1], device=weights.device).expand_as(weights)
    return torch.where(weights > 0, positions, -1).amax(dim=-1)


def inverse_cdf_draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token ids [N] for ``probs`` [N, V] (rows sum to ~1, entries >= 0) and ``uniforms`` [N] in [0, 1)."""
    rows, vocab = probs.shape
    padded = F.pad(probs, (0, -vocab % CHUNK)).view(rows, -1, CHUNK)
    chunk_mass = padded.sum(dim=-1)  # [N, C]
    chunk_cdf = chunk_mass.double().cumsum(dim=-1)
    target = uniforms.double().unsqueeze(1) * chunk_cdf[:, -1:]
    chunk = torch.searchsorted(chunk_cdf, target, right=True).squeeze(1)
    overshoot = chunk >= chunk_cdf.shape[1]
    chunk = torch.where(overshoot, _last_positive(chunk_mass), chunk)
    start = torch.where(chunk > 0, chunk_cdf.gather(1, (chunk - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    local = padded.gather(1, chunk.view(rows, 1, 1).expand(rows, 1, CHUNK)).squeeze(1)  # [N, CHUNK]
    local_cdf = local.double().cumsum(dim=-1)
    offset = torch.searchsorted(local_cdf, (target.squeeze(1) - start).unsqueeze(1), right=True).squeeze(1)
    offset = torch.where(overshoot | (offset >= CHUNK), _last_positive(local), offset)
    return chunk * CHUNK + offset


def uniform_numbers(
    generators: Sequence[torch.Generator | None], count: int, default: torch.Generator, device: torch.device
) -> torch.Tensor:
    """[len(generators), count] uniform numbers: a row with its own generator (a seeded request) takes its
    numbers from it, so its tokens do not depend on the rest of the batch; the others from ``default``."""
    out = torch.rand(len(generators), count, generator=default, device=device)
    for row, gen in enumerate(generators):
        if gen is not None:
            out[row] = torch.rand(count, generator=gen, device=device)
    return out


def reference_draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The plain definition: one float64 prefix sum over the whole row."""
    cdf = probs.double().cumsum(dim=-1)
    target = uniforms.double().unsqueeze(1) * cdf[:, -1:]
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return torch.where(index >= probs.shape[1], _last_positive(probs), index)
