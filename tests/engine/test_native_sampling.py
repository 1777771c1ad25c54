"""The C sampling kernel (engine/native/sampling.c) against the tensor pipeline it replaces: for the same
rows, parameters and uniform numbers it draws the same tokens, so its support sets and its draw are the
reference's. Rows cover peaked and flat distributions (the nucleus heap and its radix fallback), ties at
the top-k boundary, masked tokens, vocabularies that are not a multiple of the vector width, and both
builds (this host's vector code and the portable scalar one)."""

from __future__ import annotations

import random

import pytest
import torch

from kvpilot.engine.native import ops as native
from kvpilot.engine.sampling.draw import inverse_cdf_draw
from kvpilot.engine.sampling.logits_processors import RowState
from kvpilot.engine.sampling.params import SamplingParams
from kvpilot.engine.sampling.row_params import SamplingTensors
from kvpilot.engine.sampling.sampler import Sampler

BUILDS = {"native": (), "portable": ("-mno-avx2", "-mno-fma", "-mno-f16c")}
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=list(BUILDS))
def kernels(request, kvpilot_cache_dir, tmp_path_factory):
    cache = kvpilot_cache_dir if request.param == "native" else tmp_path_factory.mktemp("portable")
    return native.load_native_ops(cache, BUILDS[request.param]).sampling


def _state(params: SamplingParams, generator: torch.Generator | None = None) -> RowState:
    return RowState(params, [1], [], {0}, [], None, generator, None)


def reference_tokens(
    logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor
) -> torch.Tensor:
    """Steps 3-5 by the tensor pipeline: its filtered distributions, drawn with the same uniforms."""
    dist = Sampler(torch.Generator()).distributions(logits, [_state(p) for p in params])
    assert dist.scaled is not None and dist.idx is None  # every row samples
    return inverse_cdf_draw(dist.scaled.softmax(dim=-1), uniforms)


def native_tokens(kernels, logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor):
    return kernels.draw(logits, SamplingTensors.from_params(params, CPU).values, uniforms)


def _logits(rows: int, vocab: int, scale: float, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


# top_k, top_p, min_p (temperature varies per row)
FILTERS = [
    (-1, 1.0, 0.0),
    (1, 1.0, 0.0),
    (7, 1.0, 0.0),
    (50, 1.0, 0.0),
    (-1, 0.9, 0.0),
    (-1, 0.5, 0.0),
    (-1, 1.0, 0.1),
    (40, 0.8, 0.0),
    (40, 0.95, 0.05),
    (-1, 0.97, 0.02),
]


@pytest.mark.parametrize("vocab", [5, 4099, 9001])  # 9001: top-k by the heap, not the selection
@pytest.mark.parametrize("scale", [8.0, 1.0])  # peaked rows (small nuclei) and flat ones (radix select)
@pytest.mark.parametrize("top_k, top_p, min_p", FILTERS)
def test_draws_the_reference_tokens(kernels, vocab, scale, top_k, top_p, min_p):
    rows = 48
    logits = _logits(rows, vocab, scale, seed=vocab + int(scale))
    rng = random.Random(vocab)
    params = [
        SamplingParams(temperature=rng.choice([0.3, 0.7, 1.0, 1.6]), top_k=top_k, top_p=top_p, min_p=min_p)
        for _ in range(rows)
    ]
    uniforms = torch.rand(rows, generator=torch.Generator().manual_seed(7))
    expected = reference_tokens(logits, params, uniforms)
    assert native_tokens(kernels, logits, params, uniforms).tolist() == expected.tolist()


def test_uniforms_across_the_whole_interval_pick_the_reference_tokens(kernels):
    """One row, 400 uniforms spread over [0, 1): every token of the support is drawn where the reference
    draws it, so the kept sets and the CDF order (token ids) agree, not just one draw."""
    logits = _logits(1, 1000, 2.0, seed=3).expand(400, -1).contiguous()
    params = [SamplingParams(temperature=0.9, top_k=60, top_p=0.9)] * 400
    uniforms = (torch.arange(400, dtype=torch.float32) + 0.5) / 400
    expected = reference_tokens(logits, params, uniforms)
    got = native_tokens(kernels, logits, params, uniforms)
    assert got.tolist() == expected.tolist()
    assert len(set(expected.tolist())) > 20  # a wide support really was walked
    # negative control: a slightly smaller nucleus changes some of these draws
    smaller = [SamplingParams(temperature=0.9, top_k=60, top_p=0.85)] * 400
    assert reference_tokens(logits, smaller, uniforms).tolist() != got.tolist()


def test_ties_at_the_top_k_boundary_keep_the_lowest_ids(kernels):
    vocab = 64
    logits = torch.full((1, vocab), -5.0)
    logits[0, [3, 10, 20, 40, 50]] = 2.0  # five tokens tie for the best value
    params = [SamplingParams(temperature=1.0, top_k=3)] * 200
    uniforms = torch.rand(200, generator=torch.Generator().manual_seed(1))
    got = native_tokens(kernels, logits.expand(200, -1).contiguous(), params, uniforms)
    assert set(got.tolist()) == {3, 10, 20}
    assert got.tolist() == reference_tokens(logits.expand(200, -1).contiguous(), params, uniforms).tolist()


def test_masked_tokens_are_never_drawn(kernels):
    logits = _logits(64, 300, 1.0, seed=5)
    logits[:, 100:] = float("-inf")  # e.g. a grammar's mask
    for top_k, top_p in ((-1, 1.0), (200, 1.0), (-1, 0.99)):
        params = [SamplingParams(temperature=2.0, top_k=top_k, top_p=top_p)] * 64
        uniforms = torch.rand(64, generator=torch.Generator().manual_seed(top_k + 2))
        got = native_tokens(kernels, logits, params, uniforms)
        assert max(got.tolist()) < 100
        assert got.tolist() == reference_tokens(logits, params, uniforms).tolist()


def test_a_tiny_top_p_keeps_the_most_likely_token(kernels):
    logits = _logits(8, 50, 1.0, seed=9)
    params = [SamplingParams(temperature=1.0, top_p=1e-9)] * 8
    uniforms = torch.rand(8, generator=torch.Generator().manual_seed(2))
    assert native_tokens(kernels, logits, params, uniforms).tolist() == logits.argmax(dim=-1).tolist()
    assert reference_tokens(logits, params, uniforms).tolist() == logits.argmax(dim=-1).tolist()


def test_strided_rows_and_bad_layouts(kernels):
    wide = _logits(4, 130, 3.0, seed=4)
    logits = wide[:, :100]  # rows 130 floats apart
    params = [SamplingParams(temperature=0.8, top_k=10)] * 4
    uniforms = torch.rand(4, generator=torch.Generator().manual_seed(0))
    expected = reference_tokens(logits.contiguous(), params, uniforms)
    assert native_tokens(kernels, logits, params, uniforms).tolist() == expected.tolist()
    values = SamplingTensors.from_params(params, CPU).values
    with pytest.raises(ValueError, match="params"):
        kernels.draw(logits, values[:, :4].contiguous(), uniforms)
    with pytest.raises(ValueError, match="uniforms"):
        kernels.draw(logits, values, uniforms.double())
    with pytest.raises(ValueError, match="logits"):
        kernels.draw(logits.double(), values, uniforms)
    assert kernels.draw(logits[:0], values[:0], uniforms[:0]).tolist() == []


def test_the_sampler_draws_the_same_tokens_with_and_without_the_kernel(kernels):
    """The whole ``Sampler.sample``: greedy rows beside sampled ones, penalties, seeded rows with their own
    generators and raw logprobs give the same tokens and logprobs either way, also with typical-p and
    near-zero-temperature rows, which take the tensor steps beside the kernel's rows."""
    logits = _logits(12, 700, 4.0, seed=11)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
        SamplingParams(temperature=1.2, top_p=0.7, repetition_penalty=1.3, logprobs=3),
        SamplingParams(temperature=0.7, min_p=0.05, seed=5),
    ] * 3

    def run(native_kernels, rows_params):
        sampler = Sampler(torch.Generator().manual_seed(42), native=native_kernels)
        seeded = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in rows_params]
        states = [
            RowState(p, [1, 2, 3], [4], {0}, [], None, g, None)
            for p, g in zip(rows_params, seeded, strict=True)
        ]
        return sampler.sample(logits, states, want_sampled_logprob=[True] * len(rows_params))

    mixed = [*params[:-2], SamplingParams(temperature=0.9, typical_p=0.8), SamplingParams(temperature=1e-7)]
    for rows_params in (params, mixed):
        with_kernel, without = run(kernels, rows_params), run(None, rows_params)
        assert with_kernel.token_ids == without.token_ids
        assert with_kernel.sampled_logprobs == without.sampled_logprobs
        assert with_kernel.top_logprobs == without.top_logprobs


def test_uniform_numbers_are_consumed_as_the_tensor_path_consumes_them(kernels):
    """The kernel path draws its uniforms with ``uniform_numbers`` too: after a step, the default generator
    is where the tensor path leaves it (so the next step's draws agree as well)."""
    logits = _logits(6, 200, 2.0, seed=1)
    params = [SamplingParams(temperature=1.0, top_k=30)] * 6
    generators = []
    for native_kernels in (kernels, None):
        sampler = Sampler(torch.Generator().manual_seed(3), native=native_kernels)
        sampler.sample(logits, [_state(p) for p in params])
        generators.append(sampler.generator.get_state())
    assert torch.equal(generators[0], generators[1])
