"""YAML output for manifests: stable key order, block style, and multi-line strings kept readable."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml


class _ManifestDumper(yaml.SafeDumper):
    """SafeDumper that indents list items under their key, as kubectl and Helm output do."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_ManifestDumper.add_representer(str, _represent_str)


def dump_documents(documents: Iterable[dict[str, Any]]) -> str:
    """One YAML stream, ``---`` before every document, keys in the order the builders wrote them."""
    parts = [
        "---\n"
        + yaml.dump(document, Dumper=_ManifestDumper, sort_keys=False, width=110, default_flow_style=False)
        for document in documents
    ]
    return "".join(parts)
