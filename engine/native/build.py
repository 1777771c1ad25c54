"""Compile the kernel sources (``*.c`` beside this file) once per host into one library in the cache
directory and load it with ctypes.

The library is built with ``-O3 -march=native`` (AVX2/FMA where the CPU has them), so the cache key holds
the sources and header, the flags, the compiler's version and this CPU's model and feature flags: a cache
directory shared between different machines never hands one a library built for another. Builds are atomic (a
temporary file renamed into place), so concurrent engine processes cannot load a half-written library.
The sources compile in parallel, one compiler per core; no torch headers are involved (the kernels take
raw pointers). Every engine start on a fresh cache (a new pod) pays the build, so it is kept short: see
``SOURCE_FLAGS``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = tuple(sorted(HERE.glob("*.c")))
HEADERS = tuple(sorted(HERE.glob("*.h")))
# -ffast-math at compile time only: linking with it would add crtfastmath.o, which turns on
# flush-to-zero for the whole process (torch included) when the library loads.
COMPILE_FLAGS = (
    "-O3",
    "-march=native",
    "-ffast-math",
    "-fno-finite-math-only",
    "-fopenmp",
    "-fPIC",
    "-std=c11",
    "-Wall",
    "-Werror",
)
LINK_FLAGS = ("-shared", "-fopenmp", "-lm")
# Flags one source adds after the common ones. quant_gemm.c's fully inlined format x tile specialisations
# take gcc 45 s at -O3 and 10 s at -O2, for kernels 3-9 % slower at decode sizes
# (bench/results/native_build.md): the start-up time of every fresh pod is worth more.
# sampling.c divides logits by the temperature exactly as the PyTorch reference does: -ffast-math's
# reciprocal math would multiply by 1/T and round differently; the int8-activation kernels round activations
# to int8 exactly as their PyTorch reference does (no reassociated or reciprocal math).
SOURCE_FLAGS = {
    "quant_gemm.c": ("-O2",),
    "quant_vnni.c": ("-fno-fast-math",),
    "quant_vnni_avx2.c": ("-fno-fast-math",),
    "sampling.c": ("-fno-reciprocal-math",),
}
_TIMEOUT_S = 180

log = logging.getLogger(__name__)


class NativeBuildError(RuntimeError):
    """The C kernels could not be compiled or loaded; the message says why."""


def compiler() -> str | None:
    """The C compiler to use: ``$CC`` or ``cc``, if it is on PATH."""
    return shutil.which(os.environ.get("CC", "cc"))


def _cpu_identity() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _cache_key(cc: str, flags: tuple[str, ...]) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256()
    for part in (
        *(path.name.encode() + path.read_bytes() for path in SOURCES + HEADERS),
        " ".join(flags + LINK_FLAGS).encode(),
        repr(sorted(SOURCE_FLAGS.items())).encode(),
        version.encode(),
        platform.machine().encode(),
        _cpu_identity().encode(),
    ):
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()[:16]


def build_library(cache_dir: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """Path of the compiled library for this host, compiling it first if the cache lacks it.

    ``extra_flags`` follow the default flags (tests build the portable fallbacks with ``-mno-avx2``)."""
    cc = compiler()
    if cc is None:
        raise NativeBuildError(
            f"no C compiler found ({os.environ.get('CC', 'cc')!r} is not on PATH; "
            "install gcc to use the fused C kernels)"
        )
    flags = COMPILE_FLAGS + tuple(extra_flags)
    target = cache_dir / "native" / f"cpu_ops-{_cache_key(cc, flags)}.so"
    if target.exists():
        log.info("native CPU kernels: using the library compiled earlier, %s", target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [Path(tmp) / f"{source.stem}.o" for source in SOURCES]
        lib = Path(tmp) / "cpu_ops.so"
        compiles = [
            [cc, *flags, *SOURCE_FLAGS.get(source.name, ()), "-c", str(source), "-o", str(obj)]
            for source, obj in zip(SOURCES, objects, strict=True)
        ]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(_run, compiles))  # raises the first failure
        _run([cc, *map(str, objects), "-o", str(lib), *LINK_FLAGS])
        os.replace(lib, target)
    log.info(
        "compiled the native CPU kernels with %s into %s in %.1f s", cc, target, time.monotonic() - start
    )
    return target


def _run(command: list[str]) -> None:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise NativeBuildError(f"{' '.join(command)}: {err}") from err
    if result.returncode != 0:
        raise NativeBuildError(f"{' '.join(command)} failed:\n{result.stderr.strip()[-2000:]}")


def load_library(cache_dir: Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    path = build_library(cache_dir, extra_flags)
    try:
        return ctypes.CDLL(str(path))
    except OSError as err:
        raise NativeBuildError(f"cannot load {path}: {err}") from err
