"""Request bodies → JSON through orjson, with Python's ``json`` (the engine's parser) for what orjson refuses.

The router reads a body only to route it (its prompt, tenant and output budget) and forwards the raw bytes,
so the engine's parser stays the authority on what a body means.
"""

from __future__ import annotations

import json

import orjson


def parse_json(raw: bytes) -> object:
    """Raises ``ValueError`` for a body that is not JSON, or nests too deeply to parse (Python's ``json``
    recurses per level: a 100k-deep body would otherwise escape as a RecursionError). orjson refuses NaN,
    lone surrogates and more than 1024 levels, which ``json`` reads as the engine does."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("the body nests too deeply") from None
