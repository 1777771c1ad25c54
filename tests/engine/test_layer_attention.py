"""Per-layer attention (``LayerAttention``): layers of one step that attend differently, as Gemma's do.

One step (decodes, a fresh prompt, a prefix hit plus extend) is attended by three layers in turn on the
same prepared metadata: global, a window with soft-capping, a narrow window. Each output must equal the
PyTorch reference for that layer's window, scale and cap, on the torch backend (PyTorch ops and the C
kernels) and the Triton kernels (interpreter); the per-window masks the torch backend builds once per
step must not leak from one layer into the next.
"""

from triton_device import DEVICE  # isort: skip  (sets TRITON_INTERPRET=1 on CPU before the kernels load)

import pytest
import torch

from kvpilot.engine.attention.backend import LayerAttention
from kvpilot.engine.attention.kernels import reference
from kvpilot.engine.attention.kernels.synthetic import make_paged_batch
from kvpilot.engine.attention.torch_backend import TorchAttentionBackend
from kvpilot.engine.attention.triton_backend import TritonAttentionBackend
from kvpilot.engine.model.registry import default_cache_dir
from kvpilot.engine.native.ops import load_native_ops

CONTEXTS = [0, 15, 40, 0, 16, 9]
NEW_TOKENS = [1, 1, 1, 20, 7, 12]
NUM_DECODES = 3
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 32, 8
LAYERS = [
    LayerAttention(HEAD_DIM**-0.5),
    LayerAttention(0.3, sliding_window=24, logit_softcap=2.0),
    LayerAttention(HEAD_DIM**-0.5, sliding_window=5),
]


def attend_layers(
    backend, nhd: bool, device: torch.device = torch.device("cpu")
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    batch = make_paged_batch(
        CONTEXTS, NEW_TOKENS, HEADS, KV_HEADS, HEAD_DIM, BLOCK, torch.float32, seed=3, device=device
    )
    # slots no sequence owns hold NaN in the synthetic batch; the PyTorch path gathers whole blocks (and
    # multiplies masked-out values by 0), so they become large finite values that a wrong mask would show
    batch.key_cache.nan_to_num_(nan=30.0)
    batch.value_cache.nan_to_num_(nan=30.0)
    flat = (-1, KV_HEADS, HEAD_DIM)
    key = batch.key_cache.reshape(flat)[batch.slot_mapping]
    value = batch.value_cache.reshape(flat)[batch.slot_mapping]
    caches = (batch.key_cache, batch.value_cache)
    if not nhd:  # the torch backend's head-major blocks
        caches = tuple(c.transpose(1, 2).contiguous() for c in caches)
    meta = batch.metadata(NUM_DECODES)
    backend.prepare(meta)
    outputs = [backend.attend(batch.query, key, value, *caches, meta, layer) for layer in LAYERS]
    expected = [
        reference.reference_paged_attention(
            batch.query,
            batch.key_cache,
            batch.value_cache,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            layer.scale,
            layer.sliding_window,
            layer.logit_softcap,
        )
        for layer in LAYERS
    ]
    return outputs, expected


def check(outputs: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for out, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(out.float().cpu(), want.cpu(), atol=2e-5, rtol=0)
    # the layers really differ: one layer's mask or cap applied to another would fail
    assert min((a - b).abs().max() for a, b in zip(expected, expected[1:] + expected[:1], strict=True)) > 1e-2


@pytest.mark.parametrize("native", [False, True], ids=["pytorch-ops", "native-c"])
def test_torch_backend_attends_each_layer_its_own_way(native: bool) -> None:
    backend = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    if native:
        backend.native = load_native_ops(default_cache_dir())
    check(*attend_layers(backend, nhd=False))


@pytest.mark.triton
def test_triton_backend_attends_each_layer_its_own_way() -> None:
    backend = TritonAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    check(*attend_layers(backend, nhd=True, device=DEVICE))


def test_layer_attention_refuses_what_no_backend_can_do() -> None:
    with pytest.raises(ValueError, match="sliding_window must be a positive number of tokens"):
        LayerAttention(0.1, sliding_window=0)
    with pytest.raises(ValueError, match="logit_softcap must be positive"):
        LayerAttention(0.1, logit_softcap=-1.0)
