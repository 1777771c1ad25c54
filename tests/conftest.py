"""Fixtures shared by all test folders.

- Every test session gets its own model cache (``KVPILOT_CACHE_DIR`` under pytest's tmp dir), so tests
  never read or write ``~/.cache/kvpilot`` and each run exercises the first GGUF conversion once.
- ``tests/support/`` is put on ``sys.path``, and ``triton_device`` imported first (Triton's interpreter on
  CPU for the whole session): helpers shared across folders (``live_server``, ``polling``
  for deadline waits, ``bench_scripts`` for importing ``bench/`` scripts).
- ``tiny_model_dir``: the seeded tiny random Llama (``resolve_model("tiny-random")``), written once per
  session.
- ``smollm2_dir``: the bundled SmolLM2-135M GGUF converted to HF format, once per session (~10 s on
  2 CPU cores); tests that take it load the real model and are ``@pytest.mark.slow`` unless they are the
  one real-model test of the default run.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "support"))  # test helpers shared across folders (live_server)

# Before transformers, kvpilot or any test module imports Triton code: on CPU, TRITON_INTERPRET=1 must be set
# when Triton first loads, or an interpreted kernel fails when a test that imported Triton earlier ran first
# (test_moe_models' Triton test after test_rope_config, for one).
import triton_device  # noqa: F401  # isort: skip

import pytest

from kvpilot.engine.model.registry import resolve_model


@pytest.fixture(scope="session", autouse=True)
def kvpilot_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's model cache; exported as KVPILOT_CACHE_DIR for code that resolves models itself."""
    cache_dir = tmp_path_factory.mktemp("kvpilot-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVPILOT_CACHE_DIR", str(cache_dir))
        yield cache_dir


@pytest.fixture(scope="session")
def tiny_model_dir(kvpilot_cache_dir: Path) -> Path:
    return resolve_model("tiny-random", cache_dir=kvpilot_cache_dir, progress=False)


@pytest.fixture(scope="session")
def smollm2_dir(kvpilot_cache_dir: Path) -> Path:
    return resolve_model("smollm2-135m", cache_dir=kvpilot_cache_dir, progress=False)
