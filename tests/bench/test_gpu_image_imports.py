"""The GPU check runs on an image we do not build (``bench/gpu_image_packages.txt``) with the wheels
``bench/gpu_wheels.sh`` carries: everything the engine, the server, the bench scripts and the CUDA test files
``bench/gpu_check.sh`` names import must come from one or the other. A device session is short and rare, so
a missing wheel found there costs the whole run; here an import hook refuses every module whose
distribution is in neither list, and the same imports must still succeed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> set[str]:
    lines = (BENCH / "gpu_image_packages.txt").read_text().splitlines()
    return {normalized(line) for line in lines if line.strip() and not line.startswith("#")}


def carried_wheels() -> set[str]:
    script = (BENCH / "gpu_wheels.sh").read_text()
    block = re.search(r"^WHEELS=\((.*?)^\)", script, re.S | re.M)
    assert block, "gpu_wheels.sh has no WHEELS=( ... ) list"
    return {normalized(spec.split("==")[0]) for spec in block.group(1).split()}


def gpu_check_files() -> tuple[list[str], list[str]]:
    """(test files, bench scripts) that gpu_check.sh runs."""
    script = (BENCH / "gpu_check.sh").read_text()
    tests = [f for group in re.findall(r"files\+?=\((.*?)\)", script, re.S) for f in group.split()]
    scripts = sorted(set(re.findall(r"\$repo/bench/(\w+)\.py", script)))
    return tests, scripts


# Runs in a fresh interpreter: refuses modules of distributions outside the allowed set, then imports.
PROBE = r"""
import importlib, importlib.abc, importlib.metadata, importlib.util, json, re, sys
allowed, repo, tests, scripts = json.loads(sys.argv[1])
owners = importlib.metadata.packages_distributions()
refused = []

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

def importer():  # the file whose import statement is being run (past importlib's own frames)
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith("<frozen"):
        frame = frame.f_back
    return frame.f_code.co_filename if frame is not None else ""

class ImageOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        dists = owners.get(name.split(".")[0])
        if "." in name or not dists or any(norm(d) in allowed for d in dists):
            return None  # a submodule, the standard library, a local module, or an allowed distribution
        source = importer()
        if not source.startswith(repo + "/") or "/.venv/" in source:
            return None  # another package's own dependency: the image's versions bring theirs
        refused.append(f"{name} ({', '.join(dists)})")
        raise ModuleNotFoundError(f"{name} is not on the GPU image and gpu_wheels.sh does not carry it")

sys.meta_path.insert(0, ImageOnly())
sys.path[:0] = [f"{repo}/tests/support", f"{repo}/tests/engine", f"{repo}/tests"]
import triton_device  # noqa: F401  (what the tests' conftest imports first)
modules = ["kvpilot.engine", "kvpilot.engine.llm", "kvpilot.engine.engine_core", "kvpilot.engine.server.app",
           "kvpilot.engine.server.cli", "kvpilot.cli", "kvpilot.bench.offline_cli", "conftest"]
failed = []
for name in modules:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed.append(f"{name}: {type(exc).__name__}: {exc}")
for kind, folder, names in (("test", "tests/engine", tests), ("script", "bench", scripts)):
    for file in names:
        path = f"{repo}/{folder}/{file if file.endswith('.py') else file + '.py'}"
        spec = importlib.util.spec_from_file_location(f"probe_{kind}_{file.removesuffix('.py')}", path)
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            failed.append(f"{path}: {type(exc).__name__}: {exc}")
try:  # building an engine reaches the lazy imports (tokenizer, model, sampler, structured outputs)
    from kvpilot.engine import LLM, SamplingParams

    llm = LLM("tiny-random", device="cpu", num_kv_blocks=64)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    assert len(out[0].outputs[0].token_ids) == 2
except Exception as exc:
    failed.append(f"LLM('tiny-random'): {type(exc).__name__}: {exc}")
print(json.dumps({"failed": failed, "refused": sorted(set(refused))}))
"""


def run_probe(allowed: set[str], tmp_path: Path) -> dict:
    tests, scripts = gpu_check_files()
    args = json.dumps([sorted(allowed | {"kvpilot"}), str(REPO), tests, scripts])
    env = {"KVPILOT_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_what_the_gpu_check_imports_is_on_the_image_or_carried(tmp_path):
    tests, scripts = gpu_check_files()
    assert "test_async_scheduling.py" in tests and "step_profile" in scripts  # the lists were read
    result = run_probe(image_packages() | carried_wheels(), tmp_path)
    assert result["failed"] == [], "\n".join(result["failed"] + ["refused: " + ", ".join(result["refused"])])


def test_a_wheel_left_out_of_the_list_is_found(tmp_path):
    """Negative control: without llguidance (which the image lacks) the engine cannot be imported."""
    result = run_probe(image_packages() | (carried_wheels() - {"llguidance"}), tmp_path)
    assert any(r.startswith("llguidance") for r in result["refused"])
    assert any(f.startswith("kvpilot.engine.engine_core") for f in result["failed"])
