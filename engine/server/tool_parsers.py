"""The model's tool-call text → OpenAI ``tool_calls``, incrementally
(docs/architecture.md#structured-outputs).

Formats (``kvpilot.engine.tool_prompt.tool_call_format``):
- ``hermes`` (Qwen, Hermes, and kvpilot's prompt for templates without tools): ``<tool_call>`` blocks, each
  one JSON object ``{"name", "arguments"}`` or a list of them (SmolLM2's way), text around them is content;
- ``llama3_json``: the output is one or more ``{"name", "parameters"}`` objects separated by ``;``, or else
  plain content.

``ToolCallStream.push`` takes the text as it is generated and returns the new content and the new
tool-call deltas, the way OpenAI streams them: a call's first delta carries its ``index``, ``id``, ``type``
and ``function.name`` with ``arguments: ""``, later ones pieces of ``function.arguments``. ``arguments`` is
the model's own JSON text of the value, so the pieces of a stream join into the non-streamed string, which
is the same machine fed the whole text at once (``parse_tool_calls``): what a prefix of the text yields is
a prefix of what the whole yields, whatever the chunking. A block that holds no call (not the format) is
content, tags and all; content that is only whitespace is dropped.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from kvpilot.engine.server.tool_call_scan import ScannedCall, find_outside_strings, scan_calls, skip_space
from kvpilot.engine.tool_prompt import HERMES

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCallDelta:
    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_json(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass
class _Emitted:
    id: str
    arguments: int = 0


class ToolCallStream:
    def __init__(self, fmt: str = HERMES) -> None:
        self._fmt = fmt
        self._text = ""
        self._pos = 0
        self._in_block: int | None = None  # where the open block's text starts
        self._block_first = 0  # index of the open block's first call
        self._emitted: list[_Emitted] = []
        self._held = ""  # content that is whitespace so far
        self._content_started = False
        self._decided = fmt == HERMES  # llama3_json: calls or content, by the first character

    @property
    def called(self) -> bool:
        return bool(self._emitted)

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._text += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        s = self._text
        if not self._decided:
            start = skip_space(s, 0)
            if s.startswith(PYTHON_TAG, start):  # when special tokens are kept in the text
                start = skip_space(s, start + len(PYTHON_TAG))
            if (start == len(s) or PYTHON_TAG.startswith(s[start:])) and not final:
                return "", []
            self._decided = True
            if s[start : start + 1] == "{":
                self._in_block, self._pos = start, start
        while True:
            if self._in_block is None:
                k = s.find(OPEN, self._pos) if self._fmt == HERMES else -1
                if k < 0:
                    end = len(s) if final or self._fmt != HERMES else len(s) - _partial_tag(s, self._pos)
                    content.append(s[self._pos : end])
                    self._pos = end
                    break
                content.append(s[self._pos : k])
                self._in_block = self._pos = k + len(OPEN)
                continue
            # a close tag inside one of the call's JSON strings is the call's text, not its end
            close = find_outside_strings(s, CLOSE, self._in_block, final) if self._fmt == HERMES else -1
            block = s[self._in_block : close if close >= 0 else len(s)]
            calls, _ = scan_calls(block, ";" if self._fmt != HERMES else ",")
            found = self._diff(calls, deltas)
            if close < 0 and not final:
                break
            if not found:
                tail = CLOSE if close >= 0 else ""
                content.append((OPEN if self._fmt == HERMES else "") + block + tail)
            self._block_first = len(self._emitted)
            self._in_block = None
            self._pos = close + len(CLOSE) if close >= 0 else len(s)
            if close < 0:
                break
        return self._content("".join(content), final), deltas

    def _diff(self, calls: list[ScannedCall], deltas: list[ToolCallDelta]) -> bool:
        """Deltas for what ``calls`` add to what was sent; whether the block has a call at all."""
        for offset, call in enumerate(calls):
            index = self._block_first + offset
            if call.name is not None and call.arguments is None and call.complete:
                call.arguments, call.arguments_done = "{}", True  # a call without arguments
            if call.name is None or call.arguments is None:
                break
            if index == len(self._emitted):
                self._emitted.append(_Emitted(f"call_{uuid.uuid4().hex[:24]}"))
                deltas.append(ToolCallDelta(index, "", self._emitted[index].id, call.name))
            sent = self._emitted[index]
            arguments = call.arguments
            if arguments.startswith('"'):  # a JSON string of JSON: sent once, decoded, when complete
                if not call.arguments_done or sent.arguments:
                    continue
                arguments = str(json.loads(arguments))
                sent.arguments = len(arguments)
                deltas.append(ToolCallDelta(index, arguments))
            elif len(arguments) > sent.arguments:
                deltas.append(ToolCallDelta(index, arguments[sent.arguments :]))
                sent.arguments = len(arguments)
        return len(self._emitted) > self._block_first

    def _content(self, text: str, final: bool) -> str:
        if self._content_started:
            return text
        self._held += text
        if not self._held.strip():
            if final:
                self._held = ""
            return ""
        self._content_started = True
        text, self._held = self._held, ""
        return text


def _partial_tag(s: str, start: int) -> int:
    """Length of the longest end of ``s[start:]`` that could be the start of ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(s) - start), 0, -1):
        if OPEN.startswith(s[len(s) - n :]):
            return n
    return 0


@dataclass
class ParsedMessage:
    content: str | None
    tool_calls: list[dict] = field(default_factory=list)


def parse_tool_calls(text: str, fmt: str = HERMES) -> ParsedMessage:
    """The whole output at once: message ``content`` (None when there is none) and ``tool_calls``."""
    stream = ToolCallStream(fmt)
    content, deltas = stream.push(text)
    more, last = stream.finish()
    return ParsedMessage((content + more) or None, assemble(deltas + last))


def assemble(deltas: list[ToolCallDelta]) -> list[dict]:
    """Tool-call deltas → OpenAI ``message.tool_calls`` (as a client joins a stream's pieces)."""
    calls: list[dict] = []
    for d in deltas:
        if d.id is not None:
            calls.append({"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}})
        calls[d.index]["function"]["arguments"] += d.arguments
    return calls
