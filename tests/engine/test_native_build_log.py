"""What the native CPU kernel build logs, so a pod's log says which path the engine took: compiled now,
reused from the cache, or (no compiler) the PyTorch ops, with the fix named."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from kvpilot.engine.model.loader import resolve_native_ops
from kvpilot.engine.native.build import build_library


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records]


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs cc to compile the kernels")
def test_a_build_logs_the_compiler_and_library_then_the_cached_reuse(tmp_path: Path, caplog):
    caplog.set_level(logging.INFO, logger="kvpilot.engine.native.build")
    library = build_library(tmp_path)
    [compiled] = messages(caplog)
    assert compiled.startswith(
        f"compiled the native CPU kernels with {shutil.which('cc')} into {library} in "
    )
    caplog.clear()
    assert build_library(tmp_path) == library
    assert messages(caplog) == [f"native CPU kernels: using the library compiled earlier, {library}"]


def test_without_a_compiler_the_fallback_to_pytorch_ops_is_logged_with_the_fix(
    tmp_path: Path, monkeypatch, caplog
):
    monkeypatch.setenv("CC", "no-such-compiler-kvpilot")
    caplog.set_level(logging.WARNING, logger="kvpilot.engine.model.loader")
    assert resolve_native_ops("auto", torch.device("cpu"), torch.float32, tmp_path) is None
    assert messages(caplog) == [
        "native CPU kernels unavailable, using PyTorch ops (slower): no C compiler found "
        "('no-such-compiler-kvpilot' is not on PATH; install gcc to use the fused C kernels)"
    ]
