"""A ``StructuredOutputsParams`` → the grammar text llguidance compiles, and llguidance's verdict on it.

- ``json`` / ``json_object``: llguidance's JSON-schema compiler, strict (``lenient: false``): a keyword it
  does not implement is refused, never ignored (bench/results/structured_outputs.md), and the refusal is a
  ``GrammarError`` naming that keyword. Between JSON tokens goes at most ``JSON_WHITESPACE`` (one space,
  or a newline and up to 16 spaces or tabs of indentation: compact, spaced and pretty-printed JSON all
  pass), never a free run of whitespace, which a model can otherwise emit until ``max_tokens`` (the tiny
  test model does); ``disable_any_whitespace`` allows none;
- ``regex``: the regex as the whole output; ``choice``: one regex alternation of the escaped strings (a
  single lexeme: 40,000 choices compile in ~0.3 s, where a Lark rule of as many literals took ~3.6 s and
  failed at its first token past 2,000 choices, llguidance's items-per-row limit);
- ``grammar``: Lark as is, GBNF converted to Lark (llguidance's converter).

``build_matcher`` compiles under ``LIMITS`` and then takes the grammar's first step on llguidance itself:
the mask at the start, and the tokens every output must begin with (llguidance's forced tokens) consumed
on a copy. A grammar with no string to produce (``root ::= root``, ``[^\\s\\S]``) or whose forced start
llguidance cannot follow within its limits (``a{1000000}``) is then a ``GrammarError``, a 400 before the
request is queued, where it was an empty output with ``finish_reason: "error"``. llguidance's own error
text is passed on as its first line only; a panic inside llguidance (its text carries a backtrace) is
logged and answered with a short message.

Nothing here touches torch; ``build_matcher`` needs the llguidance tokenizer (``compiler.py`` builds it
once).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import llguidance

from kvpilot.engine.structured.params import StructuredOutputsParams

log = logging.getLogger(__name__)

#: the whitespace allowed between two JSON tokens
JSON_WHITESPACE = r"(?: |\n[ \t]{0,16})?"
#: llguidance's limits: its defaults, but errors without the parser state and the grammar (a client's
#: message, and no echo of a huge grammar), and at most 100,000 grammar symbols, refused in ~1 s where the
#: default 500,000 let a grammar reach a panic (an assertion past ~65,000 symbols; still reachable between
#: the two, and caught). Lower limits made llguidance run past 60 s on a 70,000-rule chain, so not lower.
LIMITS = llguidance.LLParserLimits(max_grammar_size=100_000, verbose_errors=False)
#: the characters the Rust regex crate treats as syntax (``regex_syntax::is_meta_character``)
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")
#: the longest llguidance message passed on to a client
_MESSAGE_CHARS = 300
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
            return llguidance.LLMatcher.grammar_from_regex("|".join(map(_escape, spec.choice or ())))
        return llguidance.grammar_from("grammar", spec.text)
    except Exception as err:  # a schema that is not JSON; a grammar the GBNF converter (Python) chokes on
        raise GrammarError(f"{kind}: {_client_message(str(err), kind)}") from None
    except BaseException as err:
        # a Rust panic in llguidance reaches Python as pyo3's PanicException, a BaseException
        if type(err).__name__ != "PanicException":
            raise
        raise GrammarError(f"{kind}: {_client_message(f'panic: {err}', kind)}") from None


def build_matcher(grammar: str, tokenizer: llguidance.LLTokenizer, kind: str) -> llguidance.LLMatcher:
    """llguidance's matcher for ``grammar`` at its start (the compile proper: lexer and parser tables);
    ``GrammarError`` if llguidance refuses the grammar or it can produce no output."""
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
    if matcher.is_error():
        message = _client_message(matcher.get_error(), kind) or "the grammar is invalid"
        raise GrammarError(f"{kind}: {message}", _keyword_of(message))
    _check_start(matcher, kind)
    return matcher


def _check_start(matcher: llguidance.LLMatcher, kind: str) -> None:
    """The grammar's first step, as the engine would take it, on llguidance: its mask at the start (no
    token and no end allowed: nothing to produce), then its forced tokens, which every output begins
    with, consumed on a copy (refused: no output can get past them). The lexer states built
    here are shared with the template's copies, so the engine's first mask for it costs less."""
    scratch = matcher.deep_copy()
    scratch.compute_bitmask()
    if not scratch.is_error():
        forced = scratch.compute_ff_tokens()
        if (not forced or scratch.consume_tokens(forced)) and not scratch.is_error():
            return
    reason = _client_message(scratch.get_error(), kind)
    if not reason or reason == "NoExtensionBias":  # llguidance's word for "no token may come next"
        reason = "no token can start it"
    raise GrammarError(f"{kind}: the grammar can produce no output ({reason})")


def _client_message(error: str, kind: str) -> str:
    """llguidance's error as a client may see it: its first line, at most ``_MESSAGE_CHARS``; a panic
    (an internal assertion, with a backtrace) is logged and replaced by a short message."""
    text = error.strip()
    if text.startswith("panic") or "<backtrace>" in text:
        log.warning("llguidance panicked compiling a %s constraint: %s", kind, text[:2000])
        return "the grammar is too large or complex to compile"
    first = text.split("\n", 1)[0].strip()
    return first if len(first) <= _MESSAGE_CHARS else first[: _MESSAGE_CHARS - 3] + "..."


def _escape(literal: str) -> str:
    """``literal`` as a Rust regex matching exactly it (``regex_syntax::escape``)."""
    return "".join("\\" + c if c in _REGEX_META else c for c in literal)


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
