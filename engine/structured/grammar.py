"""A ``StructuredOutputsParams`` → the grammar text llguidance compiles, and llguidance's verdict on it.

- ``json`` / ``json_object``: llguidance's JSON-schema compiler, strict (``lenient: false``): a keyword it
  does not implement is refused, never ignored (bench/results/structured_outputs.md), and the refusal is a
  ``GrammarError`` naming that keyword. Between JSON tokens goes at most ``JSON_WHITESPACE`` (one space,
  or a newline and up to 16 spaces or tabs of indentation: compact, spaced and pretty-printed JSON all
  pass), never a free run of whitespace, which a model can otherwise emit until ``max_tokens`` (the tiny
  test model does); ``disable_any_whitespace`` allows none;
- ``regex``: the regex as the whole output; ``choice``: a Lark rule of the literal strings;
- ``grammar``: Lark as is, GBNF converted to Lark (llguidance's converter).

Nothing here touches torch; ``build_matcher`` needs the llguidance tokenizer (``compiler.py`` builds it
once).
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance

from kvpilot.engine.structured.params import StructuredOutputsParams

#: the whitespace allowed between two JSON tokens
JSON_WHITESPACE = r"(?: |\n[ \t]{0,16})?"
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[[^\]]*\])")
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")


class GrammarError(ValueError):
    """The constraint cannot be compiled. ``keyword``: the JSON-schema keyword at fault, when one is."""

    def __init__(self, message: str, keyword: str | None = None) -> None:
        super().__init__(message)
        self.keyword = keyword


def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar definition for ``spec`` (not yet checked: ``build_matcher`` does that)."""
    kind = spec.kind
    try:
        if kind in ("json", "json_object"):
            options: Any = {"lenient": False}
            if spec.disable_any_whitespace:
                options["whitespace_flexible"] = False
            else:
                options["whitespace_pattern"] = JSON_WHITESPACE
            return llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.text)
        if kind == "choice":
            lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice or ())
            return llguidance.LLMatcher.grammar_from_lark(lark)
        return llguidance.grammar_from("grammar", spec.text)
    except Exception as err:  # a schema that is not JSON; a grammar the GBNF converter (Python) chokes on
        raise GrammarError(f"{kind}: {err}") from None


def build_matcher(grammar: str, tokenizer: llguidance.LLTokenizer, kind: str) -> llguidance.LLMatcher:
    """llguidance's matcher for ``grammar`` at its start (the compile proper: lexer and parser tables);
    ``GrammarError`` if llguidance refuses the grammar."""
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        message = matcher.get_error().strip() or "the grammar is invalid"
        raise GrammarError(f"{kind}: {message}", _keyword_of(message))
    return matcher


def _keyword_of(message: str) -> str | None:
    found = _UNIMPLEMENTED.search(message)
    if found:
        try:
            keys = json.loads(found.group(1))
        except ValueError:
            keys = []
        if keys and isinstance(keys[0], str):
            return keys[0]
    if _UNKNOWN_FORMAT.search(message):
        return "format"
    return None
