"""Tools in the chat prompt, for chat templates that do not render them (shared with the router: no torch).

A template that handles tools itself (it names ``tools``, ``tool_calls`` and the ``tool`` role, as Qwen's
and Llama 3.1's do) gets the messages and ``tools`` as sent, like HF's ``apply_chat_template``. A
template that does not (SmolLM2's, the tiny test model's) would silently drop them, so the conversation
is rewritten into the Hermes convention Qwen's template writes (docs/architecture.md#structured-outputs):

- ``tools`` → a "# Tools" section with one JSON function signature per line inside ``<tools></tools>``
  and how to call them, appended to the system message (or a system message of its own, first); shorter
  than Qwen's wording, since a model whose template lacks tools was not trained on that wording anyway
  and the section counts against its context;
- an assistant message's ``tool_calls`` → ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
  blocks after its content;
- a ``tool`` message → a user message holding ``<tool_response>...</tool_response>``.

``tool_call_format`` names the format the model answers in: ``llama3_json`` for Llama-3 templates
(``<|python_tag|>``, ``ipython``), else ``hermes`` (Qwen, Hermes, and the rewritten prompt above).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
_TOOL_ROLE = re.compile(r"""["']tool["']""")

TOOLS_HEADER = "# Tools\n\nYou may call one or more of these functions:\n<tools>"
TOOLS_FOOTER = (
    "\n</tools>\n\nTo call one, answer with its name and arguments within <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def tool_call_format(chat_template: str | None) -> str:
    template = chat_template or ""
    return LLAMA3_JSON if "<|python_tag|>" in template or "ipython" in template else HERMES


def tools_text(tools: Sequence[Any]) -> str:
    """The "# Tools" section: each tool's JSON on its own line."""
    lines = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return TOOLS_HEADER + lines + TOOLS_FOOTER


def tool_call_text(call: Any) -> str:
    """One OpenAI ``tool_calls`` entry as the model writes it (arguments as JSON, not a JSON string)."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        raise ValueError("each tool_calls entry needs a 'function' object with 'name' and 'arguments'")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # not JSON: the model sees the string it was given
            arguments = json.loads(arguments)
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def renders_tools(chat_template: str | None) -> bool:
    """The template handles tools itself: it names ``tools``, ``tool_calls`` and the ``tool`` role."""
    template = chat_template or ""
    return "tool_calls" in template and "tools" in template and bool(_TOOL_ROLE.search(template))


def prepare_tool_messages(
    chat_template: str | None, messages: list[dict[str, Any]], tools: Sequence[Any] | None
) -> list[dict[str, Any]]:
    """The messages the template is given (see the module docstring); as sent when it renders tools."""
    if renders_tools(chat_template):
        return messages
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, Mapping):  # bad input is a ValueError here, never an AttributeError
            raise ValueError(f"each message must be an object, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        calls = message.get("tool_calls")
        if role == "assistant" and calls:
            if not isinstance(calls, list):
                raise ValueError("tool_calls must be a list")
            parts = [content] if isinstance(content, str) and content else []
            content = "\n".join(parts + [tool_call_text(c) for c in calls])
            message = {k: v for k, v in message.items() if k != "tool_calls"} | {"content": content}
        elif role == "tool":
            text = content if isinstance(content, str) else ""
            message = {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
        out.append(message)
    if tools:
        section = tools_text(tools)
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out
