"""The Triton start-up check: its kernel (interpreter on CPU, compiled with ``KVPILOT_TEST_DEVICE=cuda``),
the message each failure Triton raises maps to (the real Triton functions where this machine can make
them fail: compiler lookup, a launcher build without Python.h, the libcuda lookup), and where the engine
runs it (Triton on CUDA only, before the weights load)."""

from __future__ import annotations

from triton_device import DEVICE  # isort: skip  (sets TRITON_INTERPRET=1 on CPU before the kernel is jitted)

import errno
import os
import shutil
import subprocess
import sysconfig

import pytest
import torch
import triton.backends.nvidia.driver as nvidia_driver
from triton.runtime import build as triton_build
from triton.runtime.errors import PTXASError

from kvpilot.engine.attention import gpu_preflight
from kvpilot.engine.attention.gpu_preflight import (
    COMPILER_MISSING,
    LDCONFIG_MISSING,
    LIBCUDA_MISSING,
    TritonPreflightError,
    check_triton_launch,
    explain_failure,
)

CPU = torch.device("cpu")
PREFIX = "Triton start-up check failed on cpu: "
# Triton's own message (triton/runtime/build.py) when it finds no C compiler
TRITON_NO_COMPILER = (
    "Failed to find C compiler. Please specify via CC environment variable or set triton.knobs.build.impl."
)


def failing(err: BaseException):
    def launch(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise err

    return launch


def failure_message(launch) -> str:
    with pytest.raises(TritonPreflightError) as info:
        check_triton_launch(CPU, launch)
    return str(info.value)


@pytest.mark.triton
def test_the_check_kernel_adds_and_leaves_lanes_past_n_alone():
    x = torch.arange(5, dtype=torch.float32, device=DEVICE)
    y = torch.full((5,), 0.5, device=DEVICE)
    out = torch.full((8,), -1.0, device=DEVICE)  # 8 lanes, 5 elements: the masked tail must not be written
    gpu_preflight._jit_add_kernel()[(1,)](x, y, out, 5, BLOCK=8)
    assert out.cpu().tolist() == [0.5, 1.5, 2.5, 3.5, 4.5, -1.0, -1.0, -1.0]
    assert gpu_preflight.launch_add(x, y).cpu().tolist() == [0.5, 1.5, 2.5, 3.5, 4.5]


@pytest.mark.triton
def test_the_check_passes_where_triton_works():
    assert check_triton_launch(DEVICE) is None


def test_a_kernel_that_computes_the_wrong_sum_fails_the_check():
    assert failure_message(lambda x, y: x - y) == (
        PREFIX + "the check kernel returned [-0.5, 0.5, 1.5, 2.5, 3.5] instead of [0.5, 1.5, 2.5, 3.5, 4.5]"
    )


def test_a_missing_compiler_is_named():
    assert failure_message(failing(RuntimeError(TRITON_NO_COMPILER))) == PREFIX + COMPILER_MISSING
    assert COMPILER_MISSING.startswith(
        "Triton needs a C compiler (cc/gcc) to build its launcher; install gcc in the image"
    )


def test_triton_finding_no_compiler_on_path_is_explained_as_a_missing_compiler(monkeypatch, tmp_path):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no gcc, no clang
    find = getattr(triton_build, "_find_compiler", None)  # Triton >= 3.7; before, _build looks it up
    if find is not None:
        find.cache_clear()
    try:
        with pytest.raises(RuntimeError) as info:
            if find is not None:
                find("c")
            else:
                triton_build._build("probe", "probe.c", str(tmp_path), [], [], [], [])
    finally:
        if find is not None:
            find.cache_clear()  # later builds must look the compiler up again
    assert explain_failure(info.value) == COMPILER_MISSING


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to reach Triton's compile step")
def test_a_launcher_build_without_python_h_names_the_missing_header(monkeypatch, tmp_path):
    no_headers = tmp_path / "include"
    no_headers.mkdir()
    real_get_paths = sysconfig.get_paths

    def get_paths(*args, **kwargs):
        return {**real_get_paths(*args, **kwargs), "include": str(no_headers)}

    monkeypatch.setattr(sysconfig, "get_paths", get_paths)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))  # never a cached build
    monkeypatch.delenv("CC", raising=False)
    source = f"#include <Python.h>\n/* {tmp_path} */\nint kvpilot_probe(void) {{ return 1; }}\n"
    # Triton >= 3.7 builds launchers with compile_so_from_src; 3.6 (the GPU image's) with
    # compile_module_from_src, which fails at the same compile step
    compile_source = (
        getattr(triton_build, "compile_so_from_src", None) or triton_build.compile_module_from_src
    )
    with pytest.raises(subprocess.CalledProcessError) as info:
        compile_source(source, "kvpilot_probe")
    assert explain_failure(info.value) == (
        f"Triton's launcher needs the Python headers and {no_headers / 'Python.h'} is missing: install this "
        "interpreter's headers (python3-dev, or copy its include/ directory into the image)"
    )


def test_a_failed_compile_with_the_headers_present_points_at_the_compiler_output(tmp_path):
    (tmp_path / "Python.h").write_text("")
    err = subprocess.CalledProcessError(1, ["/usr/bin/gcc", "launcher.c", "-shared"])
    assert explain_failure(err, include_dir=tmp_path) == (
        "the C compiler failed to build Triton's launcher (/usr/bin/gcc exited 1; its errors are printed "
        "above): the image needs gcc with the C library headers (libc6-dev)"
    )


def test_triton_finding_no_libcuda_is_explained(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_LIBCUDA_PATH", raising=False)
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))  # holds no libcuda.so.1
    monkeypatch.setattr(nvidia_driver.subprocess, "check_output", lambda command: b"0 libs found in cache\n")
    nvidia_driver.libcuda_dirs.cache_clear()
    try:
        with pytest.raises(AssertionError) as info:
            nvidia_driver.libcuda_dirs()
    finally:
        nvidia_driver.libcuda_dirs.cache_clear()
    assert explain_failure(info.value) == LIBCUDA_MISSING
    assert failure_message(failing(info.value)) == PREFIX + LIBCUDA_MISSING


def test_a_missing_ldconfig_is_named():
    err = FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), "/sbin/ldconfig")
    assert explain_failure(err) == LDCONFIG_MISSING


def test_a_cc_that_does_not_exist_is_named(monkeypatch):
    monkeypatch.setenv("CC", "/opt/missing/gcc")
    err = FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), "/opt/missing/gcc")
    assert explain_failure(err) == (
        "CC=/opt/missing/gcc is not an executable C compiler; install gcc in the image or unset CC"
    )


def test_ptxas_failures_are_named():
    assert explain_failure(PTXASError("ptxas fatal: Value 'sm_999' is not defined")) == (
        "Triton's bundled ptxas could not assemble a kernel for this GPU: "
        "PTXAS error: ptxas fatal: Value 'sm_999' is not defined"
    )


def test_the_root_cause_is_found_behind_a_wrapping_error():
    try:
        try:
            raise RuntimeError(TRITON_NO_COMPILER)
        except RuntimeError as inner:
            raise RuntimeError("launcher build failed") from inner
    except RuntimeError as outer:
        wrapped = outer
    assert explain_failure(wrapped) == COMPILER_MISSING


def test_an_unrecognised_failure_keeps_its_type_and_text(tmp_path):
    assert explain_failure(ValueError("unexpected"), include_dir=tmp_path) == (
        "Triton could not build and launch a kernel: ValueError: unexpected"
    )


class _StopBeforeLoading(Exception):
    """Raised in place of loading the weights: construction got past the backend choice."""


@pytest.fixture
def fake_cuda_engine(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """LLMEngine on a pretend CUDA device (no CUDA call happens before the weights load, which is
    replaced by ``_StopBeforeLoading``); returns the devices the Triton check ran for."""
    from kvpilot.engine import engine_setup

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)

    def load_model(*args, **kwargs):
        raise _StopBeforeLoading

    monkeypatch.setattr(engine_setup, "load_model", load_model)
    checks: list[torch.device] = []
    monkeypatch.setattr(gpu_preflight, "check_triton_launch", checks.append)
    return checks


def make_engine(device: str, backend: str):
    from kvpilot.engine.engine_args import EngineArgs
    from kvpilot.engine.engine_core import LLMEngine

    config = EngineArgs(
        model="tiny-random", device=device, attention_backend=backend, num_kv_blocks=16, native_cpu_ops="off"
    ).create_config()
    return LLMEngine(config)


@pytest.mark.parametrize(
    ("device", "backend", "checked"),
    [("cuda", "triton", 1), ("cuda", "auto", 1), ("cuda", "torch", 0), ("cpu", "triton", 0)],
)
def test_the_engine_checks_triton_for_the_triton_backend_on_cuda_before_loading_weights(
    fake_cuda_engine, tiny_model_dir, device, backend, checked
):
    with pytest.raises(_StopBeforeLoading):
        make_engine(device, backend)
    assert fake_cuda_engine == [torch.device("cuda", 0)] * checked


def test_a_failed_check_fails_engine_construction_before_the_weights_load(
    fake_cuda_engine, tiny_model_dir, monkeypatch
):
    def fail(device: torch.device) -> None:
        raise TritonPreflightError(f"Triton start-up check failed on {device}: {COMPILER_MISSING}")

    monkeypatch.setattr(gpu_preflight, "check_triton_launch", fail)
    with pytest.raises(
        TritonPreflightError,
        match=r"^Triton start-up check failed on cuda:0: Triton needs a C "
        r"compiler \(cc/gcc\)",
    ):
        make_engine("cuda", "triton")  # _StopBeforeLoading would mean the weights started loading
