"""Every package's ``__init__`` docstring is its map: it names each of its modules and subpackages.

For each package under ``kvpilot/``, ``engine/``, ``router/`` and ``operator/`` (every folder with an
``__init__.py``), each ``*.py`` module other than ``__init__`` and each subpackage must appear in the
package docstring as ````name```` (a subpackage may be written ````name/````). A new module without an
entry in its package's map fails here. The docstrings are read with ``ast``, so nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = ("kvpilot", "engine", "router", "operator")
#: packages whose map is known to be incomplete, with why (their owner is changing them now)


def packages() -> list[Path]:
    found = []
    for top in TOP_LEVEL:
        for init in sorted((ROOT / top).rglob("__init__.py")):
            if "__pycache__" not in init.parts:
                found.append(init.parent)
    return found


def members(package: Path) -> tuple[list[str], list[str]]:
    """(modules, subpackages) of ``package``, by name."""
    modules = sorted(p.stem for p in package.glob("*.py") if p.name != "__init__.py")
    subpackages = sorted(p.name for p in package.iterdir() if (p / "__init__.py").is_file())
    return modules, subpackages


def package_doc(package: Path) -> str:
    return ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""


def _param(package: Path):
    return pytest.param(package, id=package.relative_to(ROOT).as_posix())


def test_the_packages_are_found():
    rel = {p.relative_to(ROOT).as_posix() for p in packages()}
    assert {
        "kvpilot",
        "kvpilot/bench",
        "kvpilot/bench/compare",
        "engine",
        "engine/model",
        "engine/kv",
        "engine/attention",
        "engine/attention/kernels",
        "engine/native",
        "engine/sampling",
        "engine/server",
        "router",
        "operator",
    } <= rel


@pytest.mark.parametrize("package", [_param(p) for p in packages()])
def test_package_docstring_lists_every_module(package: Path):
    doc = package_doc(package)
    modules, subpackages = members(package)
    missing = [m for m in modules if f"``{m}``" not in doc]
    missing += [f"{s}/" for s in subpackages if f"``{s}``" not in doc and f"``{s}/``" not in doc]
    assert not missing, (
        f"{package.relative_to(ROOT)}/__init__.py: its docstring's package map does not "
        f"name {missing} (write each as ``name``)"
    )
