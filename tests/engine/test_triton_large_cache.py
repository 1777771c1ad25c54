"""A KV cache of more than 2^31 elements per layer, written and read near its end (int64 offsets).

A serving-sized cache passes 2^31 elements (an 8B model's layer at 141 GB: ~10^9 tokens·dims), so every
offset in the kernels must be 64-bit. It needs 8 GiB of device memory, which is a GPU's job: on the CPU
interpreter the allocation alone would take half of CI's memory, so this runs under
``KVPILOT_TEST_DEVICE=cuda`` (``bench/gpu_check.sh``).
"""

# Before any kernel module is imported: sets TRITON_INTERPRET=1 on CPU.
from triton_device import DEVICE  # isort: skip

import pytest
import torch

from kvpilot.engine.attention.kernels import reference
from kvpilot.engine.attention.triton_loader import load_kernels

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(DEVICE.type != "cuda", reason="needs 8 GiB of device memory (GPU check)"),
]

BLOCK, KV_HEADS, GROUP, DIM = 16, 8, 4, 128


def test_blocks_beyond_2_31_elements_are_written_and_attended():
    kernels = load_kernels(DEVICE)
    num_blocks = (1 << 31) // (BLOCK * KV_HEADS * DIM) + 8
    key_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, DIM, dtype=torch.float16, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    assert key_cache.numel() > 1 << 31
    seq_len = 40  # three blocks, the last partly filled, all past element 2^31
    table = [num_blocks - 3, num_blocks - 1, num_blocks - 2]
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(seq_len, KV_HEADS, DIM, generator=generator).to(DEVICE)
    values = torch.randn(seq_len, KV_HEADS, DIM, generator=generator).to(DEVICE)
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(seq_len)], device=DEVICE)
    kernels.kv_write.write_kv(keys, values, key_cache, value_cache, slots)
    assert torch.equal(key_cache[table[1], 0], keys[16].half())
    assert torch.equal(value_cache[table[2], 7], values[39].half())

    query = torch.randn(1, KV_HEADS * GROUP, DIM, generator=generator).to(DEVICE, torch.float16)
    out = torch.empty_like(query)
    kernels.decode.paged_decode(
        out,
        query,
        key_cache,
        value_cache,
        torch.tensor([table], dtype=torch.int32, device=DEVICE),
        torch.tensor([seq_len], dtype=torch.int32, device=DEVICE),
        DIM**-0.5,
        None,
        1,
        None,
    )
    # the reference reads the same three blocks, copied into a small cache
    small_keys = torch.cat([key_cache[:1], key_cache[table]])
    small_values = torch.cat([value_cache[:1], value_cache[table]])
    expected = reference.reference_decode(
        query,
        small_keys,
        small_values,
        torch.tensor([[1, 2, 3]], dtype=torch.int32, device=DEVICE),
        torch.tensor([seq_len], dtype=torch.int32, device=DEVICE),
        DIM**-0.5,
        None,
    )
    torch.testing.assert_close(out.float(), expected, atol=3e-3, rtol=0)
