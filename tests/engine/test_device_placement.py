"""``--device``: a CUDA device gets its index and becomes the current device (Triton launches on the current
device, so ``cuda:1`` with another current device would run kernels where the tensors are not). The CUDA
runtime is replaced by a recorder, so this runs on the CPU."""

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
