"""The MoE expert paths against the plain PyTorch reference (``moe_experts.reference_moe``): the Triton
fused-MoE kernel (in the interpreter, or a GPU with ``KVPILOT_TEST_DEVICE=cuda``) and the sorted CPU path,
for 8 and 64 experts, top-1/2/8, float32 and float16, with uneven token counts per expert (one expert
spans several 16-row blocks) and experts no token chose. Routing is checked against transformers' own
Mixtral and Qwen3-MoE routers, both renormalisation rules."""

# Before any kernel module is imported: sets TRITON_INTERPRET=1 on CPU (collection imports this first).
from triton_device import DEVICE  # isort: skip

import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from kvpilot.engine.model import fused_moe_triton
from kvpilot.engine.model.moe_experts import reference_moe, select_experts, sorted_moe

TOKENS, HIDDEN, INTER = 37, 64, 48
#: absolute tolerance on outputs of magnitude ~1 (float16: inputs, intermediate and output round)
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-2}
CASES = [(experts, top_k) for experts in (8, 64) for top_k in (1, 2, 8)]


def make_case(experts: int, top_k: int, tokens: int = TOKENS, seed: int = 0):
    """Weights and a routing with one hot expert (chosen by most tokens) and a quarter of the experts
    never chosen, whenever the remaining experts still leave top_k to choose from."""
    g = torch.Generator().manual_seed(seed + experts * 10 + top_k)
    x = torch.randn(tokens, HIDDEN, generator=g)
    w13 = torch.randn(experts, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(experts, HIDDEN, INTER, generator=g) / INTER**0.5
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, 1] += 4.0
    empty = experts // 4 if experts - experts // 4 >= top_k else 0
    if empty:
        logits[:, experts - empty :] = -1e4
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids, empty


def test_the_cases_are_uneven_and_have_empty_experts():
    # the routing the parametrized tests use really has what they claim
    for experts, top_k in CASES:
        *_, ids, empty = make_case(experts, top_k)
        counts = torch.bincount(ids.reshape(-1), minlength=experts)
        if top_k < experts:
            assert counts.max() > fused_moe_triton.BLOCK_M and counts.min() < counts.max()
        if empty:
            assert (counts == 0).sum() >= empty
    assert any(make_case(e, k)[-1] for e, k in CASES)
    # both tile configurations run: 16-row blocks for most cases, 64 x 64 tiles for 8 experts x top-8
    chosen = {fused_moe_triton.tile_sizes(TOKENS * k, e) for e, k in CASES}
    assert chosen == {(16, 32, 32), fused_moe_triton.LARGE_TILES}


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("experts, top_k", CASES)
def test_fused_moe_kernel_matches_reference(experts, top_k, dtype):
    x, w13, w2, weights, ids, _ = make_case(experts, top_k)
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    expected = reference_moe(x, w13, w2, weights, ids).float()
    got = fused_moe_triton.fused_moe(
        x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE)
    )
    assert got.dtype == dtype and got.shape == (TOKENS, HIDDEN)
    torch.testing.assert_close(got.float().cpu(), expected, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.triton
def test_fused_moe_kernel_with_large_tiles_over_sparse_experts():
    # 64-row blocks over 64 experts, a quarter of them empty: mostly padding rows, all masked
    x, w13, w2, weights, ids, _ = make_case(64, 2)
    got = fused_moe_triton.fused_moe(
        x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), tiles=(64, 64, 32)
    )
    torch.testing.assert_close(got.cpu(), reference_moe(x, w13, w2, weights, ids), atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="must be >= 16"):
        fused_moe_triton.fused_moe(x, w13, w2, weights, ids, tiles=(8, 32, 32))


@pytest.mark.triton
@pytest.mark.parametrize("tokens", [0, 1])
def test_fused_and_sorted_moe_on_one_decode_token_and_on_none(tokens):
    x, w13, w2, weights, ids, _ = make_case(64, 8, tokens=tokens)
    expected = reference_moe(x, w13, w2, weights, ids)
    got = fused_moe_triton.fused_moe(
        x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE)
    )
    assert got.shape == expected.shape == (tokens, HIDDEN)
    torch.testing.assert_close(got.cpu(), expected, atol=2e-5, rtol=0)
    torch.testing.assert_close(sorted_moe(x, w13, w2, weights, ids), expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("experts, top_k", CASES)
def test_sorted_moe_matches_reference(experts, top_k):
    x, w13, w2, weights, ids, _ = make_case(experts, top_k)
    expected = reference_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(sorted_moe(x, w13, w2, weights, ids), expected, atol=2e-5, rtol=0)
    bf16 = [t.bfloat16() for t in (x, w13, w2)]
    got = sorted_moe(*bf16, weights, ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference_moe(*bf16, weights, ids).float(), atol=0.1, rtol=0)


def test_align_block_size_gives_each_block_one_expert():
    ids = torch.tensor([[3, 0], [3, 1], [3, 0], [1, 3], [3, 0]])  # expert 2 empty, expert 3 in 5 rows
    sorted_ids, block_experts, num_padded = fused_moe_triton.align_block_size(ids, 5, block_m=4)
    flat = ids.reshape(-1)
    # counts 3, 2, 0, 5, 0 -> padded 4, 4, 0, 8, 0 rows; worst case cdiv(10 + 5 * 3, 4) * 4 = 28
    assert int(num_padded) == 16 and sorted_ids.numel() == 28
    assert sorted_ids.tolist()[:16] == [1, 5, 9, 10, 3, 6, 10, 10, 0, 2, 4, 7, 8, 10, 10, 10]
    assert block_experts.tolist()[:4] == [0, 1, 3, 3]
    real = sorted_ids[:16]
    for block in range(4):  # every real row of a block was routed to that block's expert
        rows = real[block * 4 : block * 4 + 4]
        rows = rows[rows < flat.numel()]
        assert (flat[rows] == block_experts[block]).all()
    assert sorted(real[real < flat.numel()].tolist()) == list(range(10))  # each assignment exactly once


@pytest.mark.parametrize(
    "family, norm_topk_prob", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)]
)
def test_select_experts_matches_the_hf_routers(family, norm_topk_prob):
    g = torch.Generator().manual_seed(5)
    x, gate = torch.randn(23, 32, generator=g), torch.randn(16, 32, generator=g)
    common = {"hidden_size": 32, "num_experts_per_tok": 4}
    if family == "mixtral":
        router = MixtralTopKRouter(MixtralConfig(num_local_experts=16, **common))
    else:
        config = Qwen3MoeConfig(num_experts=16, norm_topk_prob=norm_topk_prob, **common)
        router = Qwen3MoeTopKRouter(config)
    with torch.no_grad():
        router.weight.copy_(gate)
        _, hf_weights, hf_ids = router(x)
    weights, ids = select_experts(torch.nn.functional.linear(x, gate), 4, renormalize=norm_topk_prob)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, atol=1e-7, rtol=0)
    sums = weights.sum(-1)
    assert torch.allclose(sums, torch.ones(23)) == norm_topk_prob  # renormalised exactly when the rule says
