"""Chat prompts rendered from cached skeletons: the template's output with the message contents cut out.

Why: rendering a chat template through sandboxed jinja2 costs ~0.05 ms on a warm core and several times
that on one whose caches an engine step has just flushed — a large share of the router's per-request
budget, paid again by the engine's server. Most templates only *emit* each message's content: its text
lands in the output verbatim and nothing else depends on it. For such a template, the output for given
roles, other message fields and variables is a fixed skeleton with the contents spliced in; it is rendered
once per conversation shape with probe contents, and later requests of that shape are a string join.

Why it is exact — both checks must pass before a skeleton is used:

- statically (once per template), every read of a message's ``content`` (``m.content``, ``m['content']``)
  is emitted: it sits in an output expression, possibly inside ``+``/``~`` concatenations, or under a
  type-only test (``is string``, ``is defined``); the string ``'content'`` appears nowhere else
  (``map(attribute='content')``, ``m.get('content')``); no macros, ``set`` blocks, filter blocks or includes;
  no calls to functions whose result can change between renders (``strftime_now``, ``lipsum``);
- dynamically (once per shape), the probe render, whose contents are strings that trimming, escaping or
  JSON would change (edge whitespace, quotes, backslashes) and that record every look at them (comparison,
  length, iteration, any method), finds each probe verbatim in the output and nothing looked.

Anything else — a template that trims or tests content, content that is not a string, fields that are not
JSON — is rendered by jinja as before. ``tests/engine/test_chat_skeleton.py`` holds the two paths equal.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any

import jinja2
from jinja2 import nodes

#: tests that look only at a value's type, never at the text
_TYPE_TESTS = frozenset({"string", "defined", "undefined", "none"})
#: global functions whose result depends only on their arguments
_PURE_CALLS = frozenset({"raise_exception", "namespace", "range", "dict", "cycler", "joiner"})
#: statements that capture, transform or import output, so an emitted content could be inspected later
_OPAQUE_STATEMENTS = (
    nodes.Macro,
    nodes.CallBlock,
    nodes.AssignBlock,
    nodes.FilterBlock,
    nodes.Include,
    nodes.Import,
    nodes.FromImport,
    nodes.Extends,
)
_CONTENT = "content"
#: value types whose repr() differs for every two different values, across these types too
_REPR_EXACT = frozenset({str, int, float, bool, type(None)})
_INELIGIBLE = object()


def emits_content_only(template: jinja2.Template, source: str) -> bool:
    """The static check: whether ``source`` (compiled as ``template``) only emits message contents."""
    try:
        tree = template.environment.parse(source)
    except jinja2.TemplateSyntaxError:
        return False
    return not _violates(tree, ())


def _violates(node: nodes.Node, parents: tuple[nodes.Node, ...]) -> bool:
    if isinstance(node, _OPAQUE_STATEMENTS):
        return True
    if (
        isinstance(node, nodes.Call)
        and isinstance(node.node, nodes.Name)
        and node.node.name not in _PURE_CALLS
    ):
        return True
    if _reads_content(node):
        if not _emitted(node, parents):
            return True
    elif isinstance(node, nodes.Const) and node.value == _CONTENT:
        parent = parents[-1] if parents else None
        if not (isinstance(parent, nodes.Getitem) and parent.arg is node):
            return True
    return any(_violates(child, (*parents, node)) for child in node.iter_child_nodes())


def _reads_content(node: nodes.Node) -> bool:
    if isinstance(node, nodes.Getattr):
        return node.attr == _CONTENT
    return (
        isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == _CONTENT
    )


def _emitted(read: nodes.Node, parents: tuple[nodes.Node, ...]) -> bool:
    for parent in reversed(parents):
        if isinstance(parent, (nodes.Add, nodes.Concat)):
            continue
        if isinstance(parent, nodes.Output):
            return True
        return isinstance(parent, nodes.Test) and parent.node is read and parent.name in _TYPE_TESTS
    return False


class _Trace:
    looked = False


def _looking(name: str):
    method = getattr(str, name)

    def looked_at(self: _Probe, *args: Any, **kwargs: Any) -> Any:
        self.trace.looked = True
        return method(self, *args, **kwargs)

    looked_at.__name__ = name
    return looked_at


class _Probe(str):
    """A probe content: emitting it is what a skeleton needs; anything that looks at it is recorded, and
    concatenations stay probes so that looking at them is recorded too."""

    trace: _Trace

    def __new__(cls, text: str, trace: _Trace) -> _Probe:
        probe = super().__new__(cls, text)
        probe.trace = trace
        return probe

    def __add__(self, other: Any) -> Any:
        joined = str.__add__(self, other)
        return _Probe(joined, self.trace) if isinstance(joined, str) else joined

    def __radd__(self, other: Any) -> Any:
        if not isinstance(other, str):
            return NotImplemented
        return _Probe(str.__add__(other, self), self.trace)


for _name in [n for n in dir(str) if not n.startswith("_")] + [
    "__eq__",
    "__ne__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
    "__contains__",
    "__len__",
    "__iter__",
    "__getitem__",
    "__hash__",
    "__mod__",
    "__rmod__",
    "__mul__",
    "__rmul__",
    "__format__",
    "__repr__",
]:
    setattr(_Probe, _name, _looking(_name))


class ChatSkeletons:
    """Renders ``template`` by splicing contents into skeletons, one per conversation shape (LRU-bounded)."""

    def __init__(self, template: jinja2.Template, source: str, max_shapes: int = 512) -> None:
        self._template = template
        #: False: the template fails the static check and every render goes through jinja
        self.enabled = emits_content_only(template, source)
        self._max_shapes = max_shapes
        self._skeletons: dict[str, Any] = {}
        self._lock = threading.Lock()

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, variables: Mapping[str, Any]
    ) -> str | None:
        """The rendered prompt, or None where a skeleton cannot be used (the caller renders it with jinja)."""
        if not self.enabled:
            return None
        shape = _shape(messages, add_generation_prompt, variables)
        if shape is None:
            return None
        key, contents = shape
        skeleton = self._skeletons.get(key)
        if skeleton is None:
            skeleton = self._probe(messages, add_generation_prompt, variables)
            with self._lock:
                while len(self._skeletons) >= self._max_shapes:
                    self._skeletons.pop(next(iter(self._skeletons)))
                self._skeletons[key] = skeleton
        if skeleton is _INELIGIBLE:
            return None
        parts, slots = skeleton
        pieces = [parts[0]]
        for slot, part in zip(slots, parts[1:], strict=True):
            pieces.append(contents[slot])
            pieces.append(part)
        return "".join(pieces)

    def _probe(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, variables: Mapping[str, Any]
    ) -> Any:
        nonce = secrets.token_hex(6)
        # Edge whitespace (trim), quotes and a backslash (JSON, repr, HTML escaping), private-use marks.
        probes = [f" \n\"'\\\ue000{nonce}-{i}\ue001\\'\"\t " for i in range(len(messages))]
        trace = _Trace()
        probe_messages = [
            {**message, _CONTENT: _Probe(probes[i], trace)} for i, message in enumerate(messages)
        ]
        try:
            text = self._template.render(
                messages=probe_messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except Exception:  # any failure: let jinja render (and report) it the usual way
            return _INELIGIBLE
        if trace.looked:
            return _INELIGIBLE
        slot_of = {probe: i for i, probe in enumerate(probes)}
        pieces = re.split("(" + "|".join(re.escape(p) for p in probes) + ")", str(text))
        parts, slots = tuple(pieces[0::2]), tuple(slot_of[p] for p in pieces[1::2])
        if any("\ue000" + nonce in part for part in parts):
            return _INELIGIBLE  # a probe came out changed: the template transformed a content
        return parts, slots


def _shape(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, variables: Mapping[str, Any]
) -> tuple[str, list[str]] | None:
    """(key of everything but the contents, the contents), or None if a content is not a plain string or
    the rest is not JSON (the key must tell apart everything a template can see)."""
    fields, contents = [], []
    for message in messages:
        content = message.get(_CONTENT) if isinstance(message, Mapping) else None
        if type(content) is not str:
            return None
        fields.append([(name, value) for name, value in message.items() if name != _CONTENT])
        contents.append(content)
    rest = [fields, add_generation_prompt, list(variables.items())]
    # The usual shape (string roles and names, scalar variables) keys by repr, which tells apart every two
    # values of these types (1, 1.0, True, "1") and costs no Python-level encoder (on a cold core, 0.08 ms
    # of JSON encoding per request); anything nested keys by its JSON.
    if all(
        type(name) is str and type(value) in _REPR_EXACT
        for name, value in chain(chain.from_iterable(fields), rest[2])
    ):
        return "r" + repr(rest), contents
    try:
        key = json.dumps(rest, ensure_ascii=False)
    except (TypeError, ValueError):
        return None
    return "j" + key, contents
