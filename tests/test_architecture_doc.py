"""Every section of docs/architecture.md that the repository cites (``architecture.md`` + ``#`` + anchor)
is a heading that exists, and README points to the document in the repository, not to one outside it."""

from __future__ import annotations

import re
from pathlib import Path

from doc_anchors import github_anchor, heading_anchors

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
SEARCHED = (
    "README.md",
    "docs",
    "engine",
    "router",
    "operator",
    "kvpilot",
    "tests",
    "e2e",
    "bench",
    "scripts",
    "charts",
)
SUFFIXES = {".py", ".md", ".sh", ".yaml", ".tpl", ".txt", ".c", ".h"}
CITATION = re.compile(r"architecture\.md#([A-Za-z0-9_-]+)")


def anchors() -> set[str]:
    return heading_anchors(DOC)


def searched_files():
    for name in SEARCHED:
        path = ROOT / name
        files = [path] if path.is_file() else sorted(path.rglob("*"))
        for f in files:
            if f.is_file() and f.suffix in SUFFIXES and "__pycache__" not in f.parts:
                yield f


def test_github_anchor_rule():
    assert github_anchor(" KV lifecycle") == "kv-lifecycle"
    assert (
        github_anchor("Router, operator, bench and e2e packages") == "router-operator-bench-and-e2e-packages"
    )


def test_every_cited_anchor_exists():
    known = anchors()
    cited: dict[str, list[str]] = {}
    for f in searched_files():
        for anchor in CITATION.findall(f.read_text(encoding="utf-8", errors="replace")):
            cited.setdefault(anchor, []).append(str(f.relative_to(ROOT)))
    assert cited, "nothing cites docs/architecture.md by anchor"
    broken = {a: files for a, files in cited.items() if a not in known}
    assert not broken, f"citations of headings docs/architecture.md does not have: {broken}"


def test_readme_links_the_architecture_document_not_a_file_outside_the_repo():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/architecture.md" in readme
    assert "../shared" not in readme
