"""Where the engine's tensors go. ``--device``: a CUDA device gets its index and becomes the current device
(Triton launches on the current device, so ``cuda:1`` with another current device would run kernels where
the tensors are not). The CUDA
runtime is replaced by a recorder, so this runs on the CPU. Weights: streamed from the checkpoint into
parameters already on the device, one fused tensor at a time."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.model.loader import resolve_device


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    selected: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    return selected


def test_cuda_n_becomes_the_current_device(fake_cuda: list[int]) -> None:
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert fake_cuda == [1, 0, 0]


def test_a_missing_cuda_device_is_refused_by_name(fake_cuda: list[int]) -> None:
    with pytest.raises(ValueError, match=r"'cuda:2' requested but this machine has 2 CUDA device\(s\)"):
        resolve_device("cuda:2")
    assert fake_cuda == []


def test_cpu_sets_no_cuda_device(fake_cuda: list[int]) -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert fake_cuda == []


def test_cuda_without_cuda_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda:0")


def test_weights_stream_into_parameters_one_fused_tensor_at_a_time(tiny_model_dir, monkeypatch) -> None:
    """The loader never holds more checkpoint tensors than one fused parameter needs (q, k, v)."""
    import gc
    import weakref

    from kvpilot.engine.attention.torch_backend import TorchAttentionBackend
    from kvpilot.engine.model import loader

    live: list[weakref.ref] = []
    most_alive = 0
    read = loader.SafetensorsCheckpoint.__getitem__

    def counting_read(self, name: str) -> torch.Tensor:
        nonlocal most_alive
        gc.collect()
        tensor = read(self, name)
        live.append(weakref.ref(tensor))
        most_alive = max(most_alive, sum(ref() is not None for ref in live))
        return tensor

    monkeypatch.setattr(loader.SafetensorsCheckpoint, "__getitem__", counting_read)
    backend = TorchAttentionBackend(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25)
    model = loader.load_model(tiny_model_dir, torch.float32, torch.device("cpu"), backend)
    assert len(live) == 20  # every tensor of the tiny checkpoint read exactly once
    assert most_alive <= 3
    assert model.embed_tokens.weight.device.type == "cpu"
