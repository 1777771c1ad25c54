"""Markdown heading anchors as GitHub makes them, for tests that check links into the docs (``#anchor``).
Importable because ``tests/conftest.py`` puts this folder on ``sys.path``."""

from __future__ import annotations

import re
from pathlib import Path


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces → hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def heading_anchors(path: Path) -> set[str]:
    """The anchors of every heading of a Markdown file (fenced code blocks skipped)."""
    anchors, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            anchors.add(github_anchor(line.lstrip("#")))
    return anchors
