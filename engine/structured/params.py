"""``StructuredOutputsParams``: what constrains one request's output, with vLLM's names.

Exactly one of ``json`` (a JSON schema, as an object or its text), ``regex``, ``choice`` (a list of
strings), ``grammar`` (Lark, or GBNF which llguidance converts) and ``json_object`` (any JSON object) is
given. ``disable_any_whitespace`` makes JSON compact (no whitespace between tokens), as in vLLM.
``GuidedDecodingParams`` is vLLM's older name for the same thing.

``key`` identifies the compiled grammar: the kind and its text (a schema re-serialized with its key order
kept, since the order of properties is the order the model writes them in). This module imports neither
llguidance nor torch: the request boundary validates with it.

Sizes are bounded before anything compiles: at most ``MAX_CHOICES`` choices, and at most
``MAX_CONSTRAINT_BYTES`` of constraint text (UTF-8). A compile grows with its input (200,000 choices took
45-107 s and then failed inside llguidance), so a request past either bound is refused at once.
"""

from __future__ import annotations

import functools
import json as _json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")
#: the most strings a ``choice`` may list
MAX_CHOICES = 10_000
#: the most bytes of constraint text (``text`` as UTF-8: a schema's JSON, a regex, a grammar, the choices)
MAX_CONSTRAINT_BYTES = 1 << 20


class StructuredOutputsError(ValueError):
    """The structured-output parameters are malformed; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutputsParams:
    #: a JSON schema: an object, or its JSON text
    json: dict[str, Any] | bool | str | None = None
    #: a regular expression (Rust ``regex`` syntax) the whole output must match
    regex: str | None = None
    #: the output is exactly one of these strings
    choice: list[str] | tuple[str, ...] | None = None
    #: a Lark grammar (llguidance's dialect) or a GBNF grammar
    grammar: str | None = None
    #: any JSON object
    json_object: bool | None = None
    #: JSON without whitespace between tokens
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", _json.loads(self.json))
            except (ValueError, RecursionError) as err:  # RecursionError: nested past Python's stack
                raise StructuredOutputsError(f"json is not valid JSON: {err}", "json") from None
        if self.json is False:
            raise StructuredOutputsError(
                "the JSON schema false accepts no value, so no output can match", "json"
            )
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputsError(
                f"structured outputs need exactly one of {', '.join(KINDS)}; got "
                + (", ".join(given) if given else "none"),
                "structured_outputs",
            )
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise StructuredOutputsError("json must be a JSON schema (an object or a boolean)", "json")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise StructuredOutputsError(f"{name} must be a non-empty string", name)
        choice: object = self.choice  # as given: a request's JSON may hold anything here
        if choice is not None:
            if (
                not isinstance(choice, (list, tuple))
                or not choice
                or not all(isinstance(c, str) and c for c in choice)
            ):
                raise StructuredOutputsError("choice must be a non-empty list of non-empty strings", "choice")
            if len(choice) > MAX_CHOICES:
                raise StructuredOutputsError(
                    f"choice lists {len(choice)} strings; at most {MAX_CHOICES} are allowed", "choice"
                )
            object.__setattr__(self, "choice", tuple(choice))
        if self.json_object is not None and self.json_object is not True:
            raise StructuredOutputsError("json_object must be true when given", "json_object")
        try:
            size = len(self.text.encode("utf-8", "surrogatepass"))
        except RecursionError:  # a schema object nested deeper than json.dumps goes
            raise StructuredOutputsError(f"{self.kind} is nested too deeply", self.kind) from None
        if size > MAX_CONSTRAINT_BYTES:
            raise StructuredOutputsError(
                f"{self.kind} is {size} bytes; constraints may be at most {MAX_CONSTRAINT_BYTES} bytes "
                f"({MAX_CONSTRAINT_BYTES >> 20} MiB)",
                self.kind,
            )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @functools.cached_property
    def text(self) -> str:
        """The constraint as text: the schema's JSON (key order kept), the regex, the choices' JSON list.
        Computed once (the size bound, the compile cache's key and the compile each read it; a schema is up
        to a MiB of JSON), after ``__post_init__`` normalized the fields it reads."""
        kind = self.kind
        if kind == "json":
            return _json.dumps(self.json, ensure_ascii=False)
        if kind == "choice":
            return _json.dumps(list(self.choice or ()), ensure_ascii=False)
        if kind == "json_object":
            return '{"type": "object"}'
        return str(getattr(self, kind))

    @property
    def key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on (the compile cache's key)."""
        return (self.kind, self.text, self.disable_any_whitespace)


GuidedDecodingParams = StructuredOutputsParams
