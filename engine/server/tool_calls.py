"""``tools`` and ``tool_choice`` of a chat request (docs/architecture.md#structured-outputs): validated, and
for ``required`` or a named function turned into the grammar that makes the model call (Lark rules with
llguidance's inline ``%json`` schemas, one per function: its name as a constant, its ``parameters`` as
the arguments' schema), in the model's format (``kvpilot.engine.tool_prompt``).

- ``none``: the tools are in the prompt, the output is text (not parsed);
- ``auto`` (the default with tools): free output, parsed for calls afterwards;
- ``required``: one call or more (one with ``parallel_tool_calls: false``) to any of the tools;
- ``{"type": "function", "function": {"name": ...}}``: exactly one call to that function.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kvpilot.engine.server.errors import bad_request
from kvpilot.engine.structured.params import StructuredOutputsError, StructuredOutputsParams
from kvpilot.engine.tool_prompt import HERMES

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_ANY_OBJECT = {"type": "object"}
#: a call's JSON is written as chat templates write tool calls (``tojson``: ", " and ": ", no other
#: whitespace), the form the model was trained on, and never a free run of whitespace
TOOL_CALL_JSON = {
    "lenient": False,
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


@dataclass(frozen=True)
class ToolChoice:
    #: ``none``, ``auto``, ``required`` or ``named``
    mode: str
    #: the function a named choice calls
    name: str | None = None

    @property
    def parses(self) -> bool:
        """The output is read for tool calls."""
        return self.mode != "none"


def function_schemas(tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Each function's name → its parameters' JSON schema; 400 naming the bad entry."""
    out: dict[str, Any] = {}
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad_request(f"{where} must be {{'type': 'function', 'function': {{...}}}}", f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad_request(f"{where}.function must be an object", f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(
                f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'",
                f"{where}.function.name",
            )
        if name in out:
            raise bad_request(f"{where}.function.name {name!r} is given twice", f"{where}.function.name")
        parameters = function.get("parameters", _ANY_OBJECT)
        if not isinstance(parameters, dict):
            raise bad_request(
                f"{where}.function.parameters must be a JSON schema", f"{where}.function.parameters"
            )
        out[name] = parameters or _ANY_OBJECT
    return out


def tool_choice(choice: str | dict[str, Any] | None, functions: dict[str, Any]) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto" if functions else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(
                f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}", "tool_choice"
            )
        if choice == "required" and not functions:
            raise bad_request("tool_choice 'required' needs tools", "tool_choice")
        return ToolChoice(choice)
    function = choice.get("function") if choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad_request(
            "tool_choice must be {'type': 'function', 'function': {'name': ...}}", "tool_choice.function.name"
        )
    if name not in functions:
        raise bad_request(
            f"tool_choice names {name!r}, which is not one of the tools", "tool_choice.function.name"
        )
    return ToolChoice("named", name)


def call_grammar(
    choice: ToolChoice, functions: dict[str, Any], fmt: str, parallel: bool
) -> StructuredOutputsParams | None:
    """The grammar a ``required`` or named choice generates under; None for ``none`` and ``auto``."""
    if choice.mode not in ("required", "named"):
        return None
    names = [choice.name] if choice.name is not None else list(functions)
    arguments_key = "arguments" if fmt == HERMES else "parameters"
    rules = []
    for i, name in enumerate(names):
        schema = {
            "type": "object",
            "properties": {"name": {"const": name}, arguments_key: functions[name]},
            "required": ["name", arguments_key],
            "additionalProperties": False,
            "x-guidance": TOOL_CALL_JSON,
        }
        rules.append(f"fn_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    many = parallel and choice.mode == "required"
    if fmt == HERMES:
        top = 'start: call ("\\n" call)*' if many else "start: call"
        call = 'call: "<tool_call>\\n" fn "\\n</tool_call>"'
    else:
        top = 'start: fn ("; " fn)*' if many else "start: fn"
        call = ""
    alternatives = "fn: " + " | ".join(f"fn_{i}" for i in range(len(names)))
    try:
        return StructuredOutputsParams(grammar="\n".join(r for r in (top, call, alternatives, *rules) if r))
    except StructuredOutputsError as err:  # the functions' grammar is past the constraint size limit
        raise bad_request(f"tools: the forced tool call's {err}", "tools") from None
