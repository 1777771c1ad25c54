"""Exact support sets of the truncation filters and the sampler's greedy branch, temperature limits
and seeded determinism (docs/architecture.md#sampling-pipeline)."""

from __future__ import annotations

import math

import pytest
import torch

from kvpilot.engine.sampling.filters import apply_min_p, apply_top_k, apply_top_p, apply_typical_p, support
from kvpilot.engine.sampling.logits_processors import RowState
from kvpilot.engine.sampling.params import SamplingParams, SamplingParamsError
from kvpilot.engine.sampling.sampler import Sampler


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) if p > 0 else float("-inf") for p in probs]])


def top_p(logits, p):
    return apply_top_p(logits.clone(), torch.tensor([p]))


def top_k(logits, k):
    return apply_top_k(logits.clone(), torch.tensor([k]))


def typical(logits, p):
    return apply_typical_p(logits.clone(), torch.tensor([p]))


def min_p(logits, a):
    return apply_min_p(logits.clone(), torch.tensor([a]))


def test_top_p_keeps_the_boundary_token():
    z = logits_of([0.4, 0.3, 0.2, 0.1])
    assert support(top_p(z, 0.65)[0]) == {0, 1}  # 0.4 + 0.3 = 0.7 >= 0.65: the second token stays
    assert support(top_p(z, 0.4)[0]) == {0}  # reaching p exactly stops there
    assert support(top_p(z, 0.71)[0]) == {0, 1, 2}
    assert support(top_p(z, 1.0)[0]) == {0, 1, 2, 3}


def test_typical_p_excludes_the_most_likely_token():
    z = logits_of([0.02, 0.35, 0.33, 0.30])
    # H ≈ 1.173; |−log p − H| is smallest for 0.30 then 0.33: together 0.63, the most likely (0.35) is out
    assert support(typical(z, 0.63)[0]) == {2, 3}
    assert support(typical(z, 0.2)[0]) == {3}


def test_min_p_support_grows_with_temperature_and_matches_logit_threshold():
    z = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    sizes = []
    for temp in (0.2, 0.5, 1.0, 2.0, 5.0):
        kept = support(min_p(z / temp, 0.3)[0])
        expected = {i for i, zi in enumerate(z[0].tolist()) if zi >= z.max().item() + temp * math.log(0.3)}
        assert kept == expected
        sizes.append(len(kept))
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    assert 0 in support(min_p(z, 1.0)[0])  # the most likely token always stays


def test_filter_order_is_not_commutative():
    z = logits_of([0.45, 0.3, 0.15, 0.1])
    k_then_p = support(top_p(top_k(z, 3), 0.8)[0])
    p_then_k = support(top_k(top_p(z, 0.8), 3)[0])
    assert (k_then_p, p_then_k) == ({0, 1}, {0, 1, 2})


def test_top_k_ties_break_by_lower_token_id():
    z = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.5]])
    assert support(top_k(z, 2)[0]) == {1, 2}
    assert support(top_k(z, 1)[0]) == {1}
    assert support(top_k(z, 4)[0]) == {0, 1, 2, 3}


def test_shifting_all_logits_leaves_supports_unchanged():
    z = torch.tensor([[2.0, 1.5, 0.3, -1.0, -4.0]])
    for shift in (-7.0, 3.25, 100.0):
        s = z + shift
        assert support(top_k(s, 2)[0]) == support(top_k(z, 2)[0])
        assert support(top_p(s, 0.8)[0]) == support(top_p(z, 0.8)[0])
        assert support(min_p(s, 0.2)[0]) == support(min_p(z, 0.2)[0])
        assert support(typical(s, 0.5)[0]) == support(typical(z, 0.5)[0])


def test_filters_only_touch_rows_that_use_them():
    z = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    out = apply_top_k(z.clone(), torch.tensor([1, -1]))
    assert support(out[0]) == {2} and support(out[1]) == {0, 1, 2}


def row(params: SamplingParams, gen=None) -> RowState:
    return RowState(params, [], [], frozenset(), (), {}, gen)


def test_greedy_is_a_separate_branch_with_lowest_id_on_ties():
    sampler = Sampler(torch.Generator().manual_seed(0))
    z = torch.tensor([[0.0, 5.0, 5.0, 1.0]])
    assert sampler.sample(z, [row(SamplingParams(temperature=0.0))]).token_ids == [1]
    # a tiny positive temperature is not the greedy branch: it follows the ties rule (test below)
    assert (
        SamplingParams(temperature=1e-06).temperature != 0 and not SamplingParams(temperature=1e-6).is_greedy
    )


def test_temperature_to_zero_limits():
    """Unique max: mass concentrates on it. Tied maxima: mass splits 1/|A| between them."""
    sampler = Sampler(torch.Generator().manual_seed(0))
    unique = torch.tensor([[1.0, 1.5, 0.0]]).repeat(2000, 1)
    tied = torch.tensor([[2.0, 0.0, 2.0]]).repeat(4000, 1)
    p = SamplingParams(temperature=0.01)
    assert set(sampler.sample(unique, [row(p)] * 2000).token_ids) == {1}
    draws = sampler.sample(tied, [row(p)] * 4000).token_ids
    assert set(draws) == {0, 2}
    assert abs(draws.count(0) / 4000 - 0.5) < 0.04  # 1/|A| each, not one-sided


def test_near_zero_temperature_follows_the_ties_rule_not_the_greedy_branch():
    """0 < T < 1e-5 is the T -> 0 limit: uniform over tied maxima (greedy would always take the lower id)."""
    sampler = Sampler(torch.Generator().manual_seed(0))
    tied = torch.tensor([[2.0, 0.0, 2.0]]).repeat(4000, 1)
    draws = sampler.sample(tied, [row(SamplingParams(temperature=1e-7))] * 4000).token_ids
    assert set(draws) == {0, 2} and abs(draws.count(0) / 4000 - 0.5) < 0.04
    unique = torch.tensor([[1.0, 1.5, 0.0]]).repeat(500, 1)
    assert set(sampler.sample(unique, [row(SamplingParams(temperature=1e-9))] * 500).token_ids) == {1}
    # negative control: T = 0 is the greedy branch, which takes the lowest id among the ties
    assert set(sampler.sample(tied, [row(SamplingParams(temperature=0.0))] * 100).token_ids) == {0}


CHI2_CRIT_DF5_P001 = 20.52


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.05, typical_p=0.95),
    ],
)
def test_sampled_frequencies_match_the_processed_distribution(params):
    z = torch.tensor([[2.0, 1.6, 1.1, 0.7, 0.2, -0.5]])
    processed = z / params.temperature
    processed = min_p(processed, params.min_p)
    processed = top_k(processed, params.top_k)
    processed = top_p(processed, params.top_p)
    processed = typical(processed, params.typical_p)
    expected = processed.softmax(-1)[0]
    n = 12000
    sampler = Sampler(torch.Generator().manual_seed(1234))
    tokens = sampler.sample(z.repeat(n, 1), [row(params)] * n).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=6).double()
    kept = expected > 0
    assert counts[~kept].sum() == 0  # never outside the support
    chi2 = (((counts[kept] - n * expected[kept]) ** 2) / (n * expected[kept])).sum().item()
    df = int(kept.sum()) - 1
    assert chi2 < {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: CHI2_CRIT_DF5_P001}[df]


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    z = torch.randn(1, 50, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(temperature=1.0, seed=7)

    def draw(batch_rows: int, position: int) -> list[int]:
        sampler = Sampler(torch.Generator().manual_seed(batch_rows))
        gen = torch.Generator().manual_seed(7)
        out = []
        for _ in range(20):
            rows = [row(SamplingParams(temperature=1.0))] * batch_rows
            rows = [*rows[:position], row(p, gen), *rows[position:]]
            out.append(sampler.sample(z.repeat(batch_rows + 1, 1), rows).token_ids[position])
        return out

    assert draw(0, 0) == draw(5, 3) == draw(9, 9)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"temperature": -1}, "temperature"),
        ({"typical_p": 0}, "typical_p"),
        ({"n": 0}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"stop": [""]}, "stop"),
        ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size"),
        # beams report no per-token logprobs: refused rather than silently left out
        ({"use_beam_search": True, "n": 2, "logprobs": 2}, "logprobs"),
    ],
)
def test_invalid_parameters_name_the_field(kwargs, field):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**kwargs)


def _logit_rows(seed: int, vocab: int, rows: int, spread: float) -> torch.Tensor:
    """Logits with many exact ties (values on a coarse grid) and some -inf (earlier masks)."""
    gen = torch.Generator().manual_seed(seed)
    z = (torch.randn(rows, vocab, generator=gen) * spread * 4).round() / 4
    z[torch.rand(rows, vocab, generator=gen) < 0.1] = float("-inf")
    return z


@pytest.mark.parametrize("vocab, spread", [(50, 1.0), (300, 0.3), (2000, 3.0), (2000, 0.05), (5000, 8.0)])
def test_top_k_without_a_sort_keeps_the_sorted_definitions_support(vocab, spread):
    from kvpilot.engine.sampling.filters import reference_top_k

    z = _logit_rows(vocab, vocab, 12, spread)
    k = torch.tensor([1, 2, 3, 5, 17, 40, 49, vocab - 1, vocab, 0, -1, vocab // 2])
    assert torch.equal(apply_top_k(z.clone(), k), reference_top_k(z.clone(), k))


@pytest.mark.parametrize("sync_free", [False, True], ids=["candidates", "sync-free"])
@pytest.mark.parametrize("vocab, spread", [(50, 1.0), (300, 0.3), (2000, 3.0), (2000, 0.05), (5000, 8.0)])
def test_top_p_keeps_the_sorted_definitions_support(vocab, spread, sync_free):
    """On candidates (the CPU's path) peaked rows resolve on 64, flatter ones on 1024, flat ones by the
    full sort; the sync-free path (off the CPU) sorts every row whole. Every path must give the full
    sort's support exactly (ties by id included), for all rows and for host-chosen ones."""
    from kvpilot.engine.sampling.filters import reference_top_p

    z = _logit_rows(vocab + 1, vocab, 10, spread)
    p = torch.tensor([0.1, 0.5, 0.8, 0.9, 0.95, 0.99, 0.999, 1.0, 0.3, 0.7])
    expected = reference_top_p(z.clone(), p)
    assert torch.equal(apply_top_p(z.clone(), p, sync_free=sync_free), expected)
    rows = torch.tensor([1, 3, 6, 9])
    assert torch.equal(apply_top_p(z.clone(), p, rows, sync_free=sync_free)[rows], expected[rows])


def test_top_p_candidate_paths_are_all_exercised():
    """Negative control for the equivalence above: the three paths really occur on these inputs."""
    from kvpilot.engine.sampling import filters

    calls = []
    real_sort = torch.Tensor.sort

    def spy(self, *args, **kwargs):
        calls.append(self.shape[-1])
        return real_sort(self, *args, **kwargs)

    peaked, flat = _logit_rows(1, 5000, 1, 8.0), torch.zeros(1, 5000)
    try:
        torch.Tensor.sort = spy
        filters.apply_top_p(peaked.clone(), torch.tensor([0.9]))
        assert max(calls) <= 1024 and 5000 not in calls  # resolved on candidates
        calls.clear()
        filters.apply_top_p(flat.clone(), torch.tensor([0.9]))
        assert 5000 in calls  # a flat row needs the full sort
    finally:
        torch.Tensor.sort = real_sort
