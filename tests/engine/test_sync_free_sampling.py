"""The sampler's filters without host syncs give the outputs the row-selecting versions gave
(docs/architecture.md#sampling-pipeline): top-k's tie pass run for every row equals the tied-rows-only pass
and the sort-based definition; host-chosen rows (``rows``) equal processing every row with the inactive ones
masked back; the sampler with per-row parameter tensors (``row_params``, the persistent batch's gather)
draws the same tokens as without. On CUDA the filters are checked to make no synchronizing call."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.sampling.filters import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    apply_typical_p,
    reference_top_k,
    reference_top_p,
)
from kvpilot.engine.sampling.logits_processors import RowState
from kvpilot.engine.sampling.params import SamplingParams
from kvpilot.engine.sampling.row_params import FilterRows, SamplingTensors
from kvpilot.engine.sampling.sampler import Sampler


def tie_heavy(seed: int, rows: int, vocab: int, spread: float) -> torch.Tensor:
    """Logits on a coarse grid (many exact ties) with some -inf entries (earlier masks)."""
    gen = torch.Generator().manual_seed(seed)
    z = (torch.randn(rows, vocab, generator=gen) * spread * 4).round() / 4
    z[torch.rand(rows, vocab, generator=gen) < 0.1] = float("-inf")
    return z


@pytest.mark.parametrize("vocab, spread", [(50, 1.0), (300, 0.3), (2000, 0.05), (2000, 3.0)])
def test_top_k_tie_pass_for_every_row_equals_the_tied_rows_pass(vocab, spread):
    z = tie_heavy(vocab, 12, vocab, spread)
    k = torch.tensor([1, 2, 3, 5, 17, 40, 49, vocab - 1, vocab, 0, -1, vocab // 2])
    expected = reference_top_k(z.clone(), k)
    k_max = int(k[(k > 0) & (k < vocab)].max())
    for sync_free in (True, False):
        assert torch.equal(apply_top_k(z.clone(), k, sync_free=sync_free), expected)
        assert torch.equal(apply_top_k(z.clone(), k, k_max=k_max, sync_free=sync_free), expected)


def test_top_k_rows_without_enough_finite_logits_are_left_alone():
    """A k-th value of -inf (fewer finite logits than k) masks nothing: no tie pass is needed there."""
    z = torch.full((2, 6), float("-inf"))
    z[0, :2] = torch.tensor([1.0, 2.0])
    z[1] = torch.tensor([3.0, 3.0, 3.0, 1.0, 0.0, -1.0])
    for sync_free in (True, False):
        out = apply_top_k(z.clone(), torch.tensor([4, 2]), sync_free=sync_free)
        assert torch.equal(out, reference_top_k(z.clone(), torch.tensor([4, 2])))
        assert torch.isfinite(out[1]).tolist() == [True, True, False, False, False, False]


def test_host_chosen_rows_equal_masking_inactive_rows():
    z = tie_heavy(7, 8, 400, 1.0)
    params = {
        "min_p": (apply_min_p, torch.tensor([0.0, 0.1, 0.0, 0.3, 0.05, 0.0, 0.2, 0.0])),
        "top_k": (apply_top_k, torch.tensor([0, 5, -1, 40, 1, 0, 399, 400])),
        "top_p": (apply_top_p, torch.tensor([1.0, 0.9, 1.0, 0.5, 0.99, 1.0, 0.3, 1.0])),
        "typical_p": (apply_typical_p, torch.tensor([1.0, 0.9, 1.0, 0.5, 0.99, 1.0, 0.3, 1.0])),
    }
    for name, (apply, value) in params.items():
        every = apply(z.clone(), value)
        active = torch.tensor([1, 3, 4, 6])
        assert torch.equal(apply(z.clone(), value, active), every), name
        assert torch.equal(every[[0, 2, 5]], z[[0, 2, 5]]), f"{name} changed a row whose parameter is off"
    assert torch.equal(
        params["top_p"][0](z.clone(), params["top_p"][1]), reference_top_p(z.clone(), params["top_p"][1])
    )


def test_filter_rows_names_the_rows_each_filter_needs():
    params = [
        SamplingParams(temperature=0.8, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.9, min_p=0.1),
        SamplingParams(temperature=1e-7, top_k=600),  # top-k at the vocabulary size is off
    ]
    plan = FilterRows.of(params, 600, torch.device("cpu"))
    assert plan.use_top_k and plan.top_k_rows is not None and plan.top_k_rows.tolist() == [0]
    assert plan.top_k_max == 5 and plan.near_zero_temperature
    assert plan.top_p_rows is not None and plan.top_p_rows.tolist() == [1]
    assert plan.min_p_rows is not None and plan.min_p_rows.tolist() == [1] and not plan.use_typical_p
    every = FilterRows.of(params[:1] * 3, 600, torch.device("cpu"))
    assert every.use_top_k and every.top_k_rows is None  # every row: no index to gather with
    big = SamplingTensors.from_params([SamplingParams(top_k=1 << 40)], torch.device("cpu"))
    assert big.top_k.tolist() == [1 << 24]  # clamped, still off for any smaller vocabulary


def rows_of(params: list[SamplingParams], seed_rows: dict[int, int]) -> list[RowState]:
    return [
        RowState(p, [1, 2], [3], frozenset(), (), {}, torch.Generator().manual_seed(seed_rows[i]))
        if i in seed_rows
        else RowState(p, [1, 2], [3])
        for i, p in enumerate(params)
    ]


def test_sampler_with_row_param_tensors_draws_the_same_tokens():
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
        SamplingParams(temperature=1.0, min_p=0.05, logprobs=2),
        SamplingParams(temperature=0.7, typical_p=0.9),
        SamplingParams(temperature=1e-6),
        SamplingParams(temperature=1.2, top_k=3),
    ]
    z = tie_heavy(3, len(params), 300, 1.0)
    for subset in (list(range(len(params))), [1, 3, 5]):
        ps = [params[i] for i in subset]
        logits = z[subset]
        outs = []
        for with_tensors in (False, True):
            sampler = Sampler(torch.Generator().manual_seed(11))
            tensors = SamplingTensors.from_params(ps, logits.device) if with_tensors else None
            res = sampler.sample(logits.clone(), rows_of(ps, {1 % len(ps): 5}), row_params=tensors)
            outs.append((res.token_ids, res.sampled_logprobs))
        assert outs[0] == outs[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs exist only with a GPU")
def test_filters_make_no_synchronizing_call_on_cuda():
    z = tie_heavy(5, 16, 3000, 0.3).cuda()
    k = torch.full((16,), 40, device="cuda")
    p = torch.full((16,), 0.3, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        apply_min_p(z.clone(), p)
        apply_top_k(z.clone(), k, k_max=40)
        apply_top_p(z.clone(), p)
        apply_typical_p(z.clone(), torch.full((16,), 0.9, device="cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(apply_top_k(z.clone(), k, k_max=40).cpu(), reference_top_k(z.cpu(), k.cpu()))
    assert torch.equal(apply_top_p(z.clone(), p).cpu(), reference_top_p(z.cpu(), p.cpu()))
