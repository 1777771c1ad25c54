"""The single-file scripts in ``bench/`` (``router_bench``, ``router_path``, ``loopback_send``,
``step_profile``, ...) imported by tests, without putting ``bench/`` on ``sys.path``.

A script there may import a sibling script by its bare name (``from router_bench import placement``), as
running it from ``bench/`` allows; while :func:`bench_script` loads one, such a name resolves to the
sibling file (after every other finder, so it shadows nothing). Importable because ``tests/conftest.py``
puts this folder on ``sys.path``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


class _SiblingScripts(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        script = BENCH / f"{fullname}.py"
        if path is None and "." not in fullname and script.is_file():
            return importlib.util.spec_from_file_location(fullname, script)
        return None


def bench_script(name: str) -> ModuleType:
    """``bench/<name>.py`` as the module ``name`` (loaded once; dataclasses need it in ``sys.modules``)."""
    script = BENCH / f"{name}.py"
    loaded = sys.modules.get(name)
    if loaded is not None:
        if Path(getattr(loaded, "__file__", "") or "") != script:
            raise ImportError(f"{name!r} is already imported from {loaded.__file__}, not {script}")
        return loaded
    spec = importlib.util.spec_from_file_location(name, script)
    if spec is None or spec.loader is None:
        raise ImportError(f"no bench script {script}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    finder = _SiblingScripts()
    sys.meta_path.append(finder)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        sys.meta_path.remove(finder)
    return module
