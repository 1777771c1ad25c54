"""Request bodies as Python's ``json`` reads them (and so the engine), through orjson where that is the same
(a third of the time on the routing path)."""

from __future__ import annotations

import json

import orjson

_INT64_LIMIT = float(2**63)


def parse_json(raw: bytes) -> object:
    """Raises ``ValueError`` for a body that is not JSON, or nests too deeply to parse (Python's ``json``
    recurses per level: a 100k-deep body would otherwise escape as a RecursionError). orjson refuses NaN and
    lone surrogates, stops at 1024 levels, and reads an integer beyond 64 bits as a float (of magnitude
    ≥ 2**63): such bodies take ``json``."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _parse_slowly(raw)
    return _parse_slowly(raw) if _has_huge_float(body) else body


def _parse_slowly(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("the body nests too deeply") from None


def _has_huge_float(body: object) -> bool:
    pending = [body]
    while pending:
        value = pending.pop()
        kind = type(value)
        if kind is dict:
            pending.extend(value.values())  # type: ignore[attr-defined]
        elif kind is list:
            pending.extend(value)  # type: ignore[arg-type]
        elif kind is float and abs(value) >= _INT64_LIMIT:  # type: ignore[arg-type]
            return True
    return False
