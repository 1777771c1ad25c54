"""TritonAttentionBackend on CPU (Triton interpreter): a whole step's write + attend against the references,
its input validation, and the guard on how the kernel modules were imported."""

import os

# Before any kernel module is imported (collection imports this module before any test runs).
os.environ["TRITON_INTERPRET"] = "1"

import subprocess
import sys

import pytest
import torch

from kvpilot.engine.attention.backend import select_backend
from kvpilot.engine.attention.kernels import reference
from kvpilot.engine.attention.kernels.synthetic import make_paged_batch
from kvpilot.engine.attention.triton_backend import TritonAttentionBackend

pytestmark = pytest.mark.triton

TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# four decodes (contexts at and off block boundaries, an empty one, one long enough to split), then
# prefill/extend sequences: a fresh prompt, a prefix hit plus extend, a one-token extend
CONTEXTS = [0, 15, 31, 520, 0, 16, 40]
NEW_TOKENS = [1, 1, 1, 1, 20, 7, 1]
NUM_DECODES = 4


def make_step(dtype, head_dim, block_size, num_heads=6, num_kv_heads=2, seed=0):
    """A step whose new tokens' K/V are not yet in the cache: returns the batch, K/V to write, and the
    caches as they must look after the write."""
    batch = make_paged_batch(
        CONTEXTS, NEW_TOKENS, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=seed
    )
    full_keys, full_values = batch.key_cache.clone(), batch.value_cache.clone()
    flat_shape = (-1, num_kv_heads, head_dim)
    key = full_keys.view(flat_shape)[batch.slot_mapping].clone()
    value = full_values.view(flat_shape)[batch.slot_mapping].clone()
    batch.key_cache.view(flat_shape)[batch.slot_mapping] = float("nan")
    batch.value_cache.view(flat_shape)[batch.slot_mapping] = float("nan")
    return batch, key, value, full_keys, full_values


@pytest.mark.parametrize(
    "dtype, head_dim, block_size, window, num_sms, splits",
    [
        (torch.float16, 64, 16, None, None, False),  # 1 SM (the CPU default): no reason to split
        (torch.bfloat16, 64, 16, None, 64, True),  # 64 SMs to fill: the 521-token decode is split
        (torch.float16, 64, 32, 300, 64, True),
        (torch.float32, 128, 32, 24, 64, False),  # a 24-token window leaves too little to split
    ],
)
def test_forward_writes_and_attends_like_the_reference(dtype, head_dim, block_size, window, num_sms, splits):
    batch, key, value, full_keys, full_values = make_step(dtype, head_dim, block_size, seed=head_dim)
    backend = TritonAttentionBackend(6, 2, head_dim, head_dim**-0.5, sliding_window=window, num_sms=num_sms)
    meta = batch.metadata(NUM_DECODES)
    backend.prepare(meta)
    assert (meta.extras["triton_decode_plan"].num_kv_splits > 1) == splits

    out = backend.forward(batch.query, key, value, batch.key_cache, batch.value_cache, meta)

    assert torch.equal(batch.key_cache.nan_to_num(7.0), full_keys.nan_to_num(7.0))
    assert torch.equal(batch.value_cache.nan_to_num(7.0), full_values.nan_to_num(7.0))
    expected = reference.reference_paged_attention(
        batch.query,
        full_keys,
        full_values,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        head_dim**-0.5,
        window,
    )
    assert out.dtype == dtype and not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("num_sms, splits", [(1, 1), (64, 16)])
def test_a_captured_step_plans_for_any_contexts_and_stays_exact(num_sms, splits):
    """``meta.captured``: the host's decode lengths are a capture's placeholders (one token each), so the
    plan is ``plan_for_capture``'s, and the kernel, reading the real lengths, still gives the reference."""
    batch, key, value, full_keys, full_values = make_step(torch.float32, 64, 16, seed=3)
    backend = TritonAttentionBackend(6, 2, 64, 0.125, num_sms=num_sms)
    meta = batch.metadata(NUM_DECODES)
    meta.captured = True
    meta.seq_lens_host = [1] * NUM_DECODES + meta.seq_lens_host[NUM_DECODES:]
    backend.prepare(meta)
    plan = meta.extras["triton_decode_plan"]
    assert (plan.num_kv_splits, plan.min_split_tokens) == (splits, 256 if splits > 1 else 1)
    out = backend.forward(batch.query, key, value, batch.key_cache, batch.value_cache, meta)
    expected = reference.reference_paged_attention(
        batch.query, full_keys, full_values, batch.block_tables, batch.seq_lens, batch.query_start_loc, 0.125
    )
    torch.testing.assert_close(out, expected, atol=TOLERANCE[torch.float32], rtol=0)


def test_attend_prepares_when_the_engine_did_not():
    batch, key, value, *_ = make_step(torch.float32, 64, 16)
    backend = TritonAttentionBackend(6, 2, 64, 0.125)
    meta = batch.metadata(NUM_DECODES)
    backend.write_kv(key, value, batch.key_cache, batch.value_cache, meta)
    out = backend.attend(batch.query, key, value, batch.key_cache, batch.value_cache, meta)
    assert "triton_decode_plan" in meta.extras and not torch.isnan(out).any()


def test_select_backend_builds_the_triton_backend_and_cpu_warmup_is_a_no_op():
    backend = select_backend(
        "triton", torch.device("cpu"), num_heads=4, num_kv_heads=2, head_dim=64, scale=0.125
    )
    assert isinstance(backend, TritonAttentionBackend)
    cache = torch.randn(3, 16, 2, 64)
    before = cache.clone()
    backend.warmup(cache, cache, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
    assert torch.equal(cache, before)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"head_dim": 512}, "head_dim"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"num_sms": 0}, "num_sms"),
        ({"num_kv_heads": 4}, "multiple"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, message):
    arguments = {"num_heads": 6, "num_kv_heads": 2, "head_dim": 64, "scale": 0.125, **kwargs}
    with pytest.raises(ValueError, match=message):
        TritonAttentionBackend(**arguments)


def test_inputs_are_validated_before_any_kernel_runs():
    batch, key, value, *_ = make_step(torch.float16, 64, 16)
    backend = TritonAttentionBackend(6, 2, 64, 0.125)
    meta = batch.metadata(NUM_DECODES)
    with pytest.raises(ValueError, match="query must be"):
        backend.attend(batch.query[:, :4], key, value, batch.key_cache, batch.value_cache, meta)
    with pytest.raises(ValueError, match="key must be"):
        backend.write_kv(key[:-1], value, batch.key_cache, batch.value_cache, meta)
    with pytest.raises(ValueError, match="cache dtype"):
        backend.attend(batch.query, key, value, batch.key_cache.double(), batch.value_cache.double(), meta)
    with pytest.raises(ValueError, match="key_cache must be"):
        backend.attend(batch.query, key, value, batch.key_cache[:, :8], batch.value_cache[:, :8], meta)
    with pytest.raises(ValueError, match="exactly one new token"):
        backend.prepare(batch.metadata(NUM_DECODES + 1))
    wrong_dtype = batch.metadata(NUM_DECODES)
    wrong_dtype.seq_lens = wrong_dtype.seq_lens.long()
    with pytest.raises(ValueError, match=r"seq_lens must be torch\.int32"):
        backend.prepare(wrong_dtype)


def test_kernels_imported_for_compilation_are_refused_on_cpu():
    """A kernel module imported without TRITON_INTERPRET cannot be used on CPU: the error says why."""
    script = (
        "import torch\n"
        "import kvpilot.engine.attention.kernels.decode\n"
        "from kvpilot.engine.attention.triton_loader import load_kernels\n"
        "try:\n"
        "    load_kernels(torch.device('cpu'))\n"
        "except RuntimeError as error:\n"
        "    print('REFUSED:', error)\n"
    )
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    assert "REFUSED:" in result.stdout and "TRITON_INTERPRET=1" in result.stdout


def test_backend_runs_on_cpu_even_when_triton_was_imported_first():
    """transformers and torch._dynamo import triton before any TRITON_INTERPRET=1; the kernels must still
    run in the interpreter (they avoid triton's own @jit helpers, which that import compiled)."""
    script = (
        "import triton.language\n"
        "import torch\n"
        "from kvpilot.engine.attention.kernels.reference import reference_paged_attention\n"
        "from kvpilot.engine.attention.kernels.synthetic import make_paged_batch\n"
        "from kvpilot.engine.attention.triton_backend import TritonAttentionBackend\n"
        "batch = make_paged_batch([0, 40, 0], [1, 1, 9], 4, 2, 64, 16, torch.float32)\n"
        "backend = TritonAttentionBackend(4, 2, 64, 0.125)\n"
        "out = backend.attend(batch.query, None, None, batch.key_cache, batch.value_cache,\n"
        "                     batch.metadata(2))\n"
        "expected = reference_paged_attention(batch.query, batch.key_cache, batch.value_cache,\n"
        "                                     batch.block_tables, batch.seq_lens, batch.query_start_loc,\n"
        "                                     0.125)\n"
        "print('MAX_ERROR', (out - expected).abs().max().item())\n"
    )
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert float(result.stdout.split("MAX_ERROR")[1]) < 2e-5
