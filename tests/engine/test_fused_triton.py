"""The fused layer path's Triton kernels (``engine/model/fused_triton.py``) against the PyTorch layer
they replace, in the interpreter on CPU (float32, float16) or compiled with ``KVPILOT_TEST_DEVICE=cuda``;
then a whole model on the fused path against the plain one."""

from triton_device import DEVICE  # isort: skip  (sets TRITON_INTERPRET=1 on CPU before the kernels load)

import pytest
import torch
import torch.nn.functional as F

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model.fused_triton import TritonFusedOps
from kvpilot.engine.model.layers import RMSNorm
from kvpilot.engine.model.rope import RotaryEmbedding

pytestmark = pytest.mark.triton

OPS = TritonFusedOps()
#: float32 agrees to rounding; float16 within a unit or two in the last place of values of size ~1-4
TOLERANCE = {torch.float32: 2e-6, torch.float16: 4e-3}


def _rows(tokens: int, width: int, dtype: torch.dtype, seed: int, padded: int = 0) -> torch.Tensor:
    """``[tokens, width]`` rows, as a column slice of wider rows when ``padded`` (row stride > width)."""
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(tokens, width + padded, generator=gen).to(dtype).to(DEVICE)
    return full[:, :width]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("gemma", [False, True])
def test_add_rms_norm_is_the_add_then_the_layers_norm(dtype, with_delta, gemma):
    hidden = 96  # not a power of two: the row's tail is masked
    residual = _rows(5, hidden, dtype, seed=1, padded=7)
    delta = _rows(5, hidden, dtype, seed=2) if with_delta else None
    norm = RMSNorm(hidden, 1e-6, unit_offset=gemma).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 1.5, hidden))
    norm = norm.to(dtype)
    expected_residual = residual + delta if delta is not None else residual.clone()
    with torch.no_grad():
        expected = norm(expected_residual)

    out = OPS.add_rms_norm(residual, delta, norm.scale().detach(), norm.eps)

    assert out.dtype == dtype
    assert torch.equal(residual, expected_residual)  # the add, rounded as the separate add rounds it
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=0)
    # the norm really normalised (not a copy of its input)
    assert not torch.allclose(out.float(), expected_residual.float(), atol=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rotary_dim", [64, 32])  # whole heads, and Phi-style partial rotary
def test_rope_in_place_is_the_layers_rotation(dtype, rotary_dim):
    heads_q, heads_kv, head_dim, tokens = 4, 2, 64, 6
    rotary = RotaryEmbedding(rotary_dim, 512, 10000.0, None, dtype).to(DEVICE)
    qkv = _rows(tokens, (heads_q + 2 * heads_kv) * head_dim, dtype, seed=3)
    positions = torch.tensor([0, 1, 7, 100, 311, 511], device=DEVICE)
    q = qkv[:, : heads_q * head_dim].reshape(tokens, heads_q, head_dim)
    k = qkv[:, heads_q * head_dim : (heads_q + heads_kv) * head_dim].reshape(tokens, heads_kv, head_dim)
    expected_q, expected_k = RotaryEmbedding.rotate(q, k, *rotary.tables(positions))
    v_before = qkv[:, (heads_q + heads_kv) * head_dim :].clone()
    q_before = q.clone()  # q and k are views of qkv, rotated in place

    OPS.rope_(qkv, heads_q + heads_kv, head_dim, positions, rotary.cos, rotary.sin)

    got_q = qkv[:, : heads_q * head_dim].reshape(tokens, heads_q, head_dim)
    got_k = qkv[:, heads_q * head_dim : (heads_q + heads_kv) * head_dim].reshape(tokens, heads_kv, head_dim)
    torch.testing.assert_close(got_q, expected_q, atol=TOLERANCE[dtype] * 2, rtol=0)
    torch.testing.assert_close(got_k, expected_k, atol=TOLERANCE[dtype] * 2, rtol=0)
    assert torch.equal(qkv[:, (heads_q + heads_kv) * head_dim :], v_before)  # v is not rotated
    assert not torch.allclose(got_q[3], q_before[3])  # position 100 really rotated


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gelu", [False, True])
def test_gated_activation_is_the_mlps(dtype, gelu):
    inter = 1500  # more than one 1024-column program per row, with a masked tail
    gate_up = _rows(3, 2 * inter, dtype, seed=4, padded=5) * 3
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    expected = act * up

    out = OPS.gelu_tanh_mul(gate_up) if gelu else OPS.silu_mul(gate_up)

    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype] * 8, rtol=0)


def test_bad_layouts_are_refused():
    x = torch.zeros(4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        OPS.add_rms_norm(x, None, torch.ones(63, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="delta"):
        OPS.add_rms_norm(x, torch.zeros(3, 64, device=DEVICE), torch.ones(64, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="contiguous rows"):
        OPS.silu_mul(x.t())
    with pytest.raises(ValueError, match="even number of dims"):
        table = torch.zeros(8, 63, device=DEVICE)
        OPS.rope_(x, 1, 64, torch.zeros(4, dtype=torch.long, device=DEVICE), table, table)
    with pytest.raises(ValueError, match="positions"):
        table = torch.zeros(8, 64, device=DEVICE)
        OPS.rope_(x, 1, 64, torch.zeros(3, dtype=torch.long, device=DEVICE), table, table)


@pytest.mark.parametrize(("dtype", "logprob_tolerance"), [("float32", 1e-4), ("float16", 1e-2)])
def test_a_model_on_the_fused_triton_path_generates_the_plain_paths_tokens(dtype, logprob_tolerance):
    """The fused layer path with the Triton kernels (what CUDA runs) gives the plain PyTorch layers'
    greedy tokens and logprobs, prefill and decode (float16: within its rounding, measured ~2e-3)."""
    args = {
        "model": "tiny-random",
        "device": DEVICE.type,
        "dtype": dtype,
        "num_kv_blocks": 64,
        "native_cpu_ops": "off",
    }
    prompts = [[5, 9, 11, 40, 2, 7, 7, 8], [100, 3]]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)
    plain = LLM(**args)
    plain.engine.model.fused_ops = None  # on CUDA the engine chose the fused path itself
    assert plain.engine.model.native is None
    fused = LLM(**args)
    calls = {"norm": 0}
    ops = TritonFusedOps()
    norm = ops.add_rms_norm

    def counted(*a, **kw):
        calls["norm"] += 1
        return norm(*a, **kw)

    ops.add_rms_norm = counted
    fused.engine.model.fused_ops = ops
    expected = plain.generate(prompts, params)
    got = fused.generate(prompts, params)
    assert calls["norm"] > 0  # the fused path really ran
    for e, g in zip(expected, got, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        for lp_e, lp_g in zip(e.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            for token, entry in lp_e.items():
                assert abs(lp_g[token].logprob - entry.logprob) < logprob_tolerance


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the engine picks the Triton fused path on CUDA only")
def test_the_engine_runs_the_fused_triton_path_on_cuda():
    llm = LLM(model="tiny-random", device="cuda", dtype="bfloat16", num_kv_blocks=64)
    assert llm.engine.backend.name == "triton"
    assert isinstance(llm.engine.model.fused_ops, TritonFusedOps)
