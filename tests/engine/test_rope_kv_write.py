"""RoPE fused into the K/V write (``kv_write`` with a ``QKRotation``) against its references, in the
interpreter on CPU (float32, float16; float and fp8/int8 caches) or compiled with
``KVPILOT_TEST_DEVICE=cuda``: the rotation is the layer's (``RotaryEmbedding.rotate`` in float32,
rounded once), and the cache holds exactly what the plain write stores for the rotated keys. Then the
Triton backend's ``forward`` with a rotation against a separate RoPE pass and ``forward``, and a model on
the fused layer path with the Triton backend against the plain PyTorch layers."""

from triton_device import DEVICE  # isort: skip  (sets TRITON_INTERPRET=1 on CPU before the kernels load)

import pytest
import torch
from kv_quant_caches import clone_quant, empty_quantized_caches, quant_on

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.attention.kernels import reference
from kvpilot.engine.attention.kernels.synthetic import make_paged_batch
from kvpilot.engine.attention.rotation import QKRotation
from kvpilot.engine.attention.torch_backend import TorchAttentionBackend
from kvpilot.engine.attention.triton_backend import TritonAttentionBackend
from kvpilot.engine.attention.triton_loader import load_kernels
from kvpilot.engine.model.fused_triton import TritonFusedOps
from kvpilot.engine.model.rope import RotaryEmbedding

pytestmark = pytest.mark.triton

KERNELS = load_kernels(DEVICE)
#: float32 agrees to rounding; float16 within a unit in the last place of values of size ~1-4
TOLERANCE = {torch.float32: 4e-6, torch.float16: 8e-3}
POSITIONS = [0, 1, 7, 100, 311, 511]


def _qkv(tokens: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """Views of one fused projection's rows (non-contiguous, as the layer passes them)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (
        q.view(tokens, q_heads, head_dim),
        k.view(tokens, kv_heads, head_dim),
        v.view(tokens, kv_heads, head_dim),
    )


def _rotated_reference(q, k, rotary: RotaryEmbedding, positions):
    """The layer's rotation, in float32 and rounded once (what the fused kernels compute)."""
    cos, sin = (t.float() for t in rotary.tables(positions))
    rq, rk = RotaryEmbedding.rotate(q.float(), k.float(), cos, sin)
    return rq.to(q.dtype), rk.to(k.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("head_dim", "rotary_dim", "q_heads", "kv_heads", "kv_cache_dtype"),
    [
        (64, 64, 4, 2, None),  # whole heads, GQA 2
        (64, 32, 3, 3, None),  # partial rotary (Phi), MHA, head counts not powers of two
        (128, 128, 8, 1, "int8"),  # per-row scales of the rotated keys
        (32, 32, 2, 2, "fp8"),
        (80, 64, 5, 1, "int8"),  # head size not a power of two (Phi-2), padded lanes beside the scales
    ],
)
def test_rope_in_the_kv_write_rotates_then_writes(
    dtype, head_dim, rotary_dim, q_heads, kv_heads, kv_cache_dtype
):
    tokens, block_size, num_blocks = len(POSITIONS), 16, 4
    rotary = RotaryEmbedding(rotary_dim, 512, 10000.0, None, dtype).to(DEVICE)
    q, k, v = _qkv(tokens, q_heads, kv_heads, head_dim, dtype, seed=head_dim + q_heads)
    positions = torch.tensor(POSITIONS, device=DEVICE)
    expected_q, expected_k = _rotated_reference(q, k, rotary, positions)
    v_before, q_before = v.clone(), q.clone()
    # first and last slot, a block boundary, and a padded (negative) slot: its q and k still rotate
    slots = torch.tensor([0, block_size - 1, block_size, -1, 2 * block_size + 3, num_blocks * block_size - 1])
    shape = (num_blocks, block_size, kv_heads, head_dim)
    if kv_cache_dtype is None:
        caches = [torch.zeros(shape, dtype=dtype) for _ in range(2)]
        quant = expected_quant = None
    else:
        *caches, quant = empty_quantized_caches(shape, kv_cache_dtype)
        expected_quant = clone_quant(quant)
    expected_caches = [c.clone() for c in caches]
    device_caches = [c.to(DEVICE) for c in caches]
    device_quant = None if quant is None else quant_on(quant, DEVICE)

    KERNELS.kv_write.write_kv(
        k, v, *device_caches, slots.to(DEVICE), device_quant, q, QKRotation(positions, rotary.cos, rotary.sin)
    )

    torch.testing.assert_close(q, expected_q, atol=TOLERANCE[dtype], rtol=0)
    torch.testing.assert_close(k, expected_k, atol=TOLERANCE[dtype], rtol=0)
    assert torch.equal(v, v_before)  # v is written, never rotated
    assert torch.equal(q[0], q_before[0])  # position 0 is the identity
    assert not torch.allclose(q[3], q_before[3])  # position 100 really rotated
    if rotary_dim < head_dim:  # dims past the tables' width pass through exactly
        assert torch.equal(q[..., rotary_dim:], q_before[..., rotary_dim:])
    # the cache holds what the plain write stores for the keys as rotated
    reference.reference_write_kv(k.cpu(), v.cpu(), *expected_caches, slots, expected_quant)
    for got, expected in zip(device_caches, expected_caches, strict=True):
        assert torch.equal(got.cpu().view(torch.uint8), expected.view(torch.uint8))
    if quant is not None and quant.key_scales is not None:
        assert torch.equal(device_quant.key_scales.cpu(), expected_quant.key_scales)
    assert (expected_caches[0].view(torch.uint8) != 0).any()  # the reference wrote something


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backend_forward_with_a_rotation_is_rope_then_forward(dtype):
    """Decodes and a prefill in one step: the fused launch gives a separate RoPE pass's output and cache."""
    q_heads, kv_heads, head_dim = 4, 2, 64
    batch = make_paged_batch(
        [9, 30, 0], [1, 1, 5], q_heads, kv_heads, head_dim, 16, dtype, seed=5, device=DEVICE
    )
    meta = batch.metadata(2)
    tokens = meta.num_tokens
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, None, dtype).to(DEVICE)
    positions = torch.tensor([9, 30, 0, 1, 2, 3, 4], device=DEVICE)
    q, k, v = _qkv(tokens, q_heads, kv_heads, head_dim, dtype, seed=6)
    runs = []
    for fused in (False, True):
        backend = TritonAttentionBackend(q_heads, kv_heads, head_dim, 0.125)
        kc, vc = batch.key_cache.clone(), batch.value_cache.clone()
        rq, rk = q.clone(), k.clone()
        if fused:
            out = backend.forward(
                rq, rk, v, kc, vc, meta, rotation=QKRotation(positions, rotary.cos, rotary.sin)
            )
        else:
            qkv = torch.cat([rq.flatten(1), rk.flatten(1), v.flatten(1)], dim=1)
            TritonFusedOps().rope_(qkv, q_heads + kv_heads, head_dim, positions, rotary.cos, rotary.sin)
            rq = qkv[:, : q_heads * head_dim].reshape(tokens, q_heads, head_dim)
            rk = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].reshape(
                tokens, kv_heads, head_dim
            )
            out = backend.forward(rq, rk, v, kc, vc, meta)
        runs.append((out, rq, rk, kc, vc))
    for eager, fused in zip(*runs, strict=True):
        torch.testing.assert_close(fused, eager, atol=TOLERANCE[dtype], rtol=0, equal_nan=True)


def test_a_rotation_the_tables_do_not_fit_is_refused():
    backend = TritonAttentionBackend(2, 1, 64, 0.125)
    batch = make_paged_batch([3], [2], 2, 1, 64, 16, torch.float32, seed=1, device=DEVICE)
    q, k, v = _qkv(2, 2, 1, 64, torch.float32, seed=2)
    table = torch.zeros(8, 64, device=DEVICE)
    args = (q, k, v, batch.key_cache, batch.value_cache, batch.metadata(0))
    positions = torch.zeros(2, dtype=torch.long, device=DEVICE)
    odd = torch.zeros(8, 63, device=DEVICE)
    with pytest.raises(ValueError, match="rotary even"):
        backend.forward(*args, rotation=QKRotation(positions, odd, odd))
    with pytest.raises(ValueError, match="positions must be"):
        backend.forward(*args, rotation=QKRotation(positions[:1], table, table))
    with pytest.raises(ValueError, match="contiguous, got stride 2"):
        strided = torch.zeros(4, dtype=torch.long, device=DEVICE)[::2]
        backend.forward(*args, rotation=QKRotation(strided, table, table))
    with pytest.raises(ValueError, match="one shape"):
        backend.forward(*args, rotation=QKRotation(positions, table, table[:4]))
    torch_backend = TorchAttentionBackend(2, 1, 64, 0.125)
    with pytest.raises(ValueError, match="does not rotate"):
        torch_backend.forward(*args, rotation=QKRotation(positions, table, table))


def test_a_model_on_the_triton_backend_rotates_in_the_kv_write():
    """The fused layer path on the Triton backend (what CUDA runs) makes one launch for RoPE and the K/V
    write, and gives the plain PyTorch layers' greedy tokens and logprobs."""
    args = {"model": "tiny-random", "device": DEVICE.type, "dtype": "float32", "num_kv_blocks": 64}
    prompts = [[5, 9, 11, 40, 2, 7, 7, 8], [100, 3]]
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=2)
    plain = LLM(**args, native_cpu_ops="off", attention_backend="torch")
    plain.engine.model.fused_ops = None
    fused = LLM(**args, native_cpu_ops="off", attention_backend="triton")
    ops = TritonFusedOps()
    calls = {"rope_": 0, "rotating_writes": 0}

    def separate_rope(*a, **kw):
        calls["rope_"] += 1
        return TritonFusedOps.rope_(ops, *a, **kw)

    write_kv = KERNELS.kv_write.write_kv

    def counted_write(*a, **kw):
        calls["rotating_writes"] += len(a) > 7 and a[7] is not None
        return write_kv(*a, **kw)

    ops.rope_ = separate_rope
    fused.engine.model.fused_ops = ops
    expected = plain.generate(prompts, params)
    KERNELS.kv_write.write_kv = counted_write
    try:
        got = fused.generate(prompts, params)
    finally:
        KERNELS.kv_write.write_kv = write_kv
    assert calls["rope_"] == 0 and calls["rotating_writes"] > 0  # no separate RoPE pass ran
    for e, g in zip(expected, got, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        for lp_e, lp_g in zip(e.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            for token, entry in lp_e.items():
                assert abs(lp_g[token].logprob - entry.logprob) < 1e-4
