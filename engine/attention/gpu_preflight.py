"""Start-up check that Triton can build and launch a kernel on this GPU, run before ``/ready``.

Triton builds a small C launcher the first time it launches a kernel, with a C compiler (``$CC``, else
gcc, else clang on PATH), this interpreter's headers (``Python.h``) and the driver's ``libcuda.so.1``.
An image lacking one of them loads the model and then fails in the first forward with an error that
does not say what to install, and the pod crash-loops. ``LLMEngine`` therefore launches one tiny kernel
when its backend is Triton on CUDA, right after choosing the backend (before the weights load, the profiled
forward and warm-up, so well before ``/ready``), and turns a failure into a start-up error that names the
missing piece.

The kernel is wrapped in ``triton.jit`` at the first check, not at import, so ``TRITON_INTERPRET`` is
read then (as ``load_kernels`` does for the attention kernels): on CPU the check runs in the
interpreter, which is how its tests run it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import subprocess
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.errors import PTXASError

log = logging.getLogger(__name__)

#: elements added; fewer than BLOCK, so the check also exercises a masked tail
NUM_ELEMENTS = 5
BLOCK = 8
#: the path Triton runs to find libcuda.so.1 (triton/backends/nvidia/driver.py)
LDCONFIG = "/sbin/ldconfig"

COMPILER_MISSING = (
    "Triton needs a C compiler (cc/gcc) to build its launcher; install gcc in the image "
    "(Triton looks for $CC, then gcc, then clang on PATH)"
)
LIBCUDA_MISSING = (
    "Triton cannot find the CUDA driver library libcuda.so.1 (neither `ldconfig -p` nor "
    "LD_LIBRARY_PATH lists it): run the pod with the NVIDIA container runtime / GPU device "
    "plugin, or set TRITON_LIBCUDA_PATH to the directory that holds libcuda.so.1"
)
LDCONFIG_MISSING = (
    f"Triton runs {LDCONFIG} -p to find libcuda.so.1 and the image has no {LDCONFIG}: "
    "install libc-bin, or set TRITON_LIBCUDA_PATH to the directory that holds libcuda.so.1"
)


class TritonPreflightError(RuntimeError):
    """Triton cannot build or launch kernels here; the message names the missing piece."""


def _add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)


@functools.cache
def _jit_add_kernel() -> Any:  # triton.jit's JITFunction (Triton has no types)
    return triton.jit(_add_kernel)


def launch_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + y`` computed by a Triton kernel (one program of BLOCK lanes)."""
    out = torch.empty_like(x)
    _jit_add_kernel()[(1,)](x, y, out, x.numel(), BLOCK=BLOCK)
    return out


def python_include_dir() -> Path:
    """The directory Triton adds to the launcher's include path for ``Python.h`` (same rule as
    ``triton.runtime.build._build``: the default scheme, with Debian's posix_local read as posix_prefix)."""
    scheme = sysconfig.get_default_scheme()
    if scheme == "posix_local":
        scheme = "posix_prefix"
    return Path(sysconfig.get_paths(scheme=scheme)["include"])


def _causes(err: BaseException) -> Iterator[BaseException]:
    """``err`` and the exceptions it was raised from (Triton may wrap the root cause)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _explain_one(err: BaseException, include_dir: Path) -> str | None:
    text = str(err)
    if isinstance(err, RuntimeError) and "Failed to find C compiler" in text:
        return COMPILER_MISSING
    if isinstance(err, AssertionError) and "libcuda.so cannot found" in text:
        return LIBCUDA_MISSING
    if isinstance(err, FileNotFoundError) and err.filename is not None:
        if str(err.filename) == LDCONFIG:
            return LDCONFIG_MISSING
        if str(err.filename) == os.environ.get("CC"):
            return f"CC={err.filename} is not an executable C compiler; install gcc in the image or unset CC"
    if isinstance(err, subprocess.CalledProcessError):
        if not (include_dir / "Python.h").is_file():
            return (
                f"Triton's launcher needs the Python headers and {include_dir / 'Python.h'} is missing: "
                "install this interpreter's headers (python3-dev, or copy its include/ directory into "
                "the image)"
            )
        command = err.cmd[0] if isinstance(err.cmd, list | tuple) and err.cmd else err.cmd
        return (
            f"the C compiler failed to build Triton's launcher ({command} exited {err.returncode}; its "
            "errors are printed above): the image needs gcc with the C library headers (libc6-dev)"
        )
    if isinstance(err, PTXASError):
        return f"Triton's bundled ptxas could not assemble a kernel for this GPU: {text}"
    return None


def explain_failure(err: BaseException, include_dir: Path | None = None) -> str:
    """What is missing, judged from the exception a Triton launch raised (and its causes)."""
    include = include_dir if include_dir is not None else python_include_dir()
    for cause in _causes(err):
        explanation = _explain_one(cause, include)
        if explanation is not None:
            return explanation
    return f"Triton could not build and launch a kernel: {type(err).__name__}: {err}"


def _on_device(device: torch.device) -> contextlib.AbstractContextManager:
    # Triton launches on the current CUDA device: make it the tensors' device
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def check_triton_launch(
    device: torch.device, launch: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = launch_add
) -> None:
    """Launch one tiny kernel on ``device`` and compare it with torch; ``TritonPreflightError`` (naming
    the missing piece) when it cannot be built or launched, or computes the wrong sum."""
    start = time.monotonic()
    x = torch.arange(NUM_ELEMENTS, dtype=torch.float32, device=device)
    y = torch.full((NUM_ELEMENTS,), 0.5, dtype=torch.float32, device=device)
    expected = x.cpu() + y.cpu()
    try:
        with _on_device(device):
            got = launch(x, y).cpu()  # .cpu() waits for the kernel, so launch errors surface here
    except Exception as err:
        raise TritonPreflightError(
            f"Triton start-up check failed on {device}: {explain_failure(err)}"
        ) from err
    if not torch.equal(got, expected):
        raise TritonPreflightError(
            f"Triton start-up check failed on {device}: the check kernel returned "
            f"{got.tolist()} instead of {expected.tolist()}"
        )
    log.info(
        "Triton start-up check passed on %s in %.2f s (launcher built, kernel launched)",
        device,
        time.monotonic() - start,
    )
