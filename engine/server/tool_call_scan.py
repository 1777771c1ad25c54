"""Scanning a model's tool-call text as it grows (``tool_parsers``): how far its JSON objects go, the calls
they hold so far (``scan_calls``), and where a tag outside the JSON strings is (``find_outside_strings``).
Every function reads a prefix the same way the whole text would be read, so a stream's deltas join into
the non-streamed result.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\n\r"
_ARG_KEYS = ("arguments", "parameters")


@dataclass
class ScannedCall:
    """One call as far as the text has shown it."""

    name: str | None = None
    #: the raw JSON text of the arguments value seen so far (None: its key not reached yet)
    arguments: str | None = None
    arguments_done: bool = False
    #: the whole object has been read
    complete: bool = False


def skip_space(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _value_end(s: str, i: int) -> int | None:
    """End (exclusive) of the JSON value that starts at ``s[i]``; None if the text ends first."""
    c = s[i]
    if c in "{[":
        depth, in_string, escaped = 0, False, False
        for j in range(i, len(s)):
            ch = s[j]
            if in_string:
                escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
        return None
    if c == '"':
        escaped = False
        for j in range(i + 1, len(s)):
            if escaped:
                escaped = False
            elif s[j] == "\\":
                escaped = True
            elif s[j] == '"':
                return j + 1
        return None
    j = i
    while j < len(s) and s[j] not in ",}];" + _WS:
        j += 1
    return j if j < len(s) else None


NOT_A_CALL = -1


def _scan_object(s: str, i: int, call: ScannedCall) -> int | None:
    """Fill ``call`` from the object at ``s[i] == '{'``: its end, None if incomplete, ``NOT_A_CALL``."""
    j = skip_space(s, i + 1)
    while j < len(s):
        if s[j] == "}":
            return j + 1
        if s[j] != '"':
            return NOT_A_CALL
        key_end = _value_end(s, j)
        if key_end is None:
            return None
        key = json.loads(s[j:key_end])
        j = skip_space(s, key_end)
        if j >= len(s):
            return None
        if s[j] != ":":
            return NOT_A_CALL
        j = skip_space(s, j + 1)
        if j >= len(s):
            return None
        end = _value_end(s, j)
        if key == "name":
            if end is None:
                return None
            name = json.loads(s[j:end])
            if not isinstance(name, str):
                return NOT_A_CALL
            call.name = name
        elif key in _ARG_KEYS and not call.arguments_done:
            # the first arguments key is the call's: a later one (a duplicate) would replace text a stream
            # has already sent, so it is ignored, as the whole text's parse ignores it
            call.arguments, call.arguments_done = s[j : len(s) if end is None else end], end is not None
        if end is None:
            return None
        j = skip_space(s, end)
        if j < len(s) and s[j] == ",":
            j = skip_space(s, j + 1)
        elif j < len(s) and s[j] != "}":
            return NOT_A_CALL
    return None


def scan_calls(s: str, separator: str) -> tuple[list[ScannedCall], bool]:
    """The calls in ``s``: one object, a ``[...]`` list of them, or objects joined by ``separator``.
    Returns them with whether the text is still the format (False: something else was found)."""
    calls: list[ScannedCall] = []
    j = skip_space(s, 0)
    in_list = j < len(s) and s[j] == "["
    j = skip_space(s, j + 1) if in_list else j
    while j < len(s):
        if s[j] != "{":
            return calls, False
        call = ScannedCall()
        calls.append(call)
        end = _scan_object(s, j, call)
        if end is None or end == NOT_A_CALL:
            return calls, end is None
        call.complete = True
        j = skip_space(s, end)
        if j < len(s) and s[j] in (",", separator) and (in_list or s[j] == separator):
            j = skip_space(s, j + 1)
        elif j < len(s) and not (in_list and s[j] == "]"):
            return calls, False
        elif j < len(s):
            return calls, skip_space(s, j + 1) == len(s)
    return calls, True


def find_outside_strings(s: str, tag: str, start: int, final: bool) -> int:
    """Where ``tag`` first occurs in ``s[start:]`` outside a JSON string, -1 if it does not (yet). At the
    end of the text (``final``) an unclosed string means it was not JSON: the first ``tag`` anywhere."""
    in_string = escaped = False
    for i in range(start, len(s)):
        ch = s[i]
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif s.startswith(tag, i):
            return i
    return s.find(tag, start) if final and in_string else -1
