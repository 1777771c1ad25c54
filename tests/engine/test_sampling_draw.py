"""Inverse-CDF drawing (``sampling/draw.py``): the two-level CDF picks what one float64 prefix sum picks,
never an entry of probability 0, and its frequencies match the distribution across chunk boundaries."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.sampling.draw import CHUNK, inverse_cdf_draw, reference_draw

CHI2_CRIT_DF7_P001 = 24.32


def test_two_level_cdf_picks_what_the_float64_prefix_sum_picks():
    gen = torch.Generator().manual_seed(0)
    for vocab in (7, CHUNK, CHUNK + 1, 1000, 49152):
        logits = torch.randn(64, vocab, generator=gen) * 3
        logits[torch.rand(64, vocab, generator=gen) < 0.3] = float("-inf")
        logits[:, 0] = 0.0  # every row keeps a finite entry
        probs = logits.softmax(dim=-1)
        uniforms = torch.rand(64, generator=gen)
        uniforms[:4] = torch.tensor([0.0, 1.0 - 2.0**-24, 0.5, 2.0**-24])
        assert torch.equal(inverse_cdf_draw(probs, uniforms), reference_draw(probs, uniforms)), vocab


def test_entries_of_probability_zero_are_never_drawn():
    probs = torch.zeros(4096, 3 * CHUNK)
    probs[:, [0, CHUNK - 1, CHUNK + 5, 3 * CHUNK - 1]] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    uniforms = torch.cat([torch.linspace(0, 1 - 2.0**-24, 4000), torch.tensor([0.1, 0.3, 0.6] * 32)])
    drawn = set(inverse_cdf_draw(probs, uniforms).tolist())
    assert drawn == {0, CHUNK - 1, CHUNK + 5, 3 * CHUNK - 1}
    # the boundaries: a uniform exactly at an entry's start belongs to that entry
    edges = inverse_cdf_draw(probs[:3], torch.tensor([0.1, 0.3, 0.6], dtype=torch.float64).float())
    assert edges.tolist() == [CHUNK - 1, CHUNK + 5, 3 * CHUNK - 1]


def _chi2(tokens: torch.Tensor, support: list[int], expected: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=3 * CHUNK).double()
    assert counts.sum() == counts[support].sum()
    n = tokens.numel()
    return float((((counts[support] - n * expected) ** 2) / (n * expected)).sum())


def test_frequencies_match_across_chunk_boundaries_and_a_wrong_draw_is_caught():
    support = [3, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK - 1, 2 * CHUNK, 2 * CHUNK + 9, 3 * CHUNK - 1]
    expected = torch.tensor([0.05, 0.2, 0.1, 0.15, 0.05, 0.25, 0.1, 0.1], dtype=torch.float64)
    n = 20000
    probs = torch.zeros(n, 3 * CHUNK)
    probs[:, support] = expected.float()
    uniforms = torch.rand(n, generator=torch.Generator().manual_seed(5))
    assert _chi2(inverse_cdf_draw(probs, uniforms), support, expected) < CHI2_CRIT_DF7_P001
    # negative control: one entry's mass misattributed (drawn as its neighbour) is detected
    wrong = inverse_cdf_draw(probs, uniforms)
    wrong[wrong == CHUNK] = CHUNK + 1
    with pytest.raises(AssertionError):
        assert _chi2(wrong, support, expected) < CHI2_CRIT_DF7_P001
