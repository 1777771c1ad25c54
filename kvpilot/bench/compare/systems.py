"""How each served system is started: the vLLM CPU build and ``kvpilot serve``, same model, same cores.

vLLM (``python -m vllm.entrypoints.openai.api_server`` from its own venv):
- ``--dtype float32`` and the resolved SmolLM2 directory, so it runs kvpilot's exact weights;
  ``--served-model-name`` so both servers answer to the same model id; ``--max-model-len 2048`` bounds the
  profiling run (prompts here are far shorter); ``--seed 0``.
- ``VLLM_CPU_OMP_THREADS_BIND=0-1`` binds its OpenMP threads to the machine's two cores and
  ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` keeps none back for the front end (with two cores, reserving one
  would halve the GEMM threads). ``VLLM_CPU_KVCACHE_SPACE`` (GiB) sizes its KV cache: 1 GiB holds ~23k
  tokens of this model, far more than 32 requests here need.
- torch.compile stays at vLLM's CPU default (Dynamo traced once, Inductor C++ backend); a start compiles
  for minutes (vLLM 0.32.0 saves the artefact under ``~/.cache/vllm`` but here fails to load it again, so
  every start compiles; :func:`vllm_startup_note` reports it). ``--vllm-arg --enforce-eager`` turns it off.
- Hub access is off (``HF_HUB_OFFLINE``), and so are vLLM's usage statistics.

kvpilot: ``python -m kvpilot.cli serve --model smollm2-135m --host 127.0.0.1 --port N`` (``smollm2-135m``
resolves to the same directory), ready when ``/ready`` answers 200 (weights loaded, warm-up done).

All three get the same OMP_WAIT_POLICY (``--omp-wait-policy``, PASSIVE unless told otherwise), so the
OpenMP runtime is not one of the differences being measured.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from kvpilot.bench.compare.servers import ServerSpec

VLLM_KVCACHE_GIB = 1
VLLM_MAX_MODEL_LEN = 2048
SERVED_MODEL_NAME = "smollm2-135m"
KVPILOT_CHECK_TIMEOUT_S = 120.0


def vllm_env(threads_bind: str, extra: dict[str, str]) -> dict[str, str]:
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": threads_bind,
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KVCACHE_GIB),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    return {**env, **extra}


def vllm_spec(
    python: Path,
    model_dir: Path,
    port: int,
    threads_bind: str,
    extra_args: list[str],
    extra_env: dict[str, str],
    base_env: dict[str, str],
    start_timeout_s: float,
) -> ServerSpec:
    argv = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(VLLM_MAX_MODEL_LEN),
        "--seed",
        "0",
        *extra_args,
    ]
    return ServerSpec(
        name="vllm",
        argv=argv,
        port=port,
        ready_path="/health",
        env=vllm_env(threads_bind, extra_env),
        base_env=base_env,
        start_timeout_s=start_timeout_s,
    )


def vllm_startup_note(server_log: str) -> str:
    """What vLLM's start did about torch.compile, from its log: its own engine-init time, and whether it
    compiled afresh because the saved artefact failed to load (vLLM 0.32.0 on CPU: "'function' object
    has no attribute 'finalize_loading'", so every start recompiles)."""
    init = re.search(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s", server_log)
    reload_failed = re.search(r"Compiling model again due to a load failure.*?reason: ([^\n]*)", server_log)
    parts = [
        f"engine init incl. compilation {float(init.group(1)):.0f} s"
        if init
        else "engine init time not logged"
    ]
    if reload_failed:
        parts.append(
            f"the saved compile artefact failed to load ({reload_failed.group(1).strip()}), so it "
            "compiled again"
        )
    return "; ".join(parts)


def kvpilot_spec(
    model: str, port: int, extra_args: list[str], extra_env: dict[str, str], start_timeout_s: float
) -> ServerSpec:
    argv = [
        sys.executable,
        "-m",
        "kvpilot.cli",
        "serve",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra_args,
    ]
    return ServerSpec(
        name="kvpilot",
        argv=argv,
        port=port,
        ready_path="/ready",
        env=extra_env,
        start_timeout_s=start_timeout_s,
    )


def kvpilot_serve_missing() -> str | None:
    """Why ``kvpilot serve`` cannot run here (its module missing or broken), or None when it can."""
    argv = [sys.executable, "-m", "kvpilot.cli", "serve", "--help"]
    try:
        # cwd: `python -m` puts it on sys.path, and at the repo root operator/ shadows the stdlib.
        result = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=KVPILOT_CHECK_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            cwd=tempfile.gettempdir(),
        )
    except subprocess.TimeoutExpired:
        return f"`kvpilot serve --help` did not answer within {KVPILOT_CHECK_TIMEOUT_S:g} s"
    if result.returncode == 0:
        return None
    last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
    return f"`kvpilot serve --help` exited with code {result.returncode}: {last}"


def describe_command(spec: ServerSpec, shown_env: tuple[str, ...]) -> str:
    """The server's command line and the environment variables that matter, for the report."""
    args = " ".join(spec.argv[1:]).replace(f"--port {spec.port}", "--port N")
    env = " ".join(f"{key}={spec.env[key]}" for key in shown_env if key in spec.env)
    return f"`{env + ' ' if env else ''}python {args}`"
