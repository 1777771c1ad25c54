"""Hostile constraints on the tiny model's tokenizer (docs/architecture.md#structured-outputs): size bounds
checked before anything compiles, grammars that can produce no output refused at compile time, choices
compiled as one escaped regex, llguidance's panics never passed on, deep rule chains compiled on the
compile threads' deep stacks."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from polling import wait_until

from kvpilot.engine.structured import compiler as compiler_module
from kvpilot.engine.structured import grammar
from kvpilot.engine.structured.compiler import GrammarCompiler, _deep_stack_pool
from kvpilot.engine.structured.grammar import GrammarError
from kvpilot.engine.structured.params import (
    MAX_CHOICES,
    MAX_CONSTRAINT_BYTES,
    StructuredOutputsError,
    StructuredOutputsParams,
)
from kvpilot.engine.tokenizer import Tokenizer


def walk(compiler: GrammarCompiler, tokenizer: Tokenizer, spec: StructuredOutputsParams, text: str) -> bool:
    """Whether ``text`` (as the tokenizer splits it) is a complete output of ``spec``'s grammar."""
    matcher = compiler.matcher(spec)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept(t) for t in ids) and matcher.ll.is_accepting()


def test_choices_are_bounded_in_number():
    assert len(StructuredOutputsParams(choice=["x"] * MAX_CHOICES).choice or ()) == MAX_CHOICES
    with pytest.raises(StructuredOutputsError, match=r"choice lists 10001 strings; at most 10000") as exc:
        StructuredOutputsParams(choice=["x"] * (MAX_CHOICES + 1))
    assert exc.value.param == "choice"


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        ("regex", "a" * (MAX_CONSTRAINT_BYTES + 1)),
        ("grammar", 'start: "' + "a" * MAX_CONSTRAINT_BYTES + '"'),
        ("choice", ["é" * (MAX_CONSTRAINT_BYTES // 4)] * 3),  # 2 bytes a character in UTF-8
        ("json", {"type": "object", "description": "d" * MAX_CONSTRAINT_BYTES}),
    ],
)
def test_constraint_text_is_bounded_in_bytes(kind, value):
    with pytest.raises(StructuredOutputsError, match=r"constraints may be at most 1048576 bytes") as exc:
        StructuredOutputsParams(**{kind: value})
    assert exc.value.param == kind


def test_a_schema_nested_past_the_python_stack_is_refused():
    # the text was a RecursionError out of json.loads: a 500 on guided_json
    deep = '{"type": "array", "items": ' * 100_000 + "{}" + "}" * 100_000
    with pytest.raises(StructuredOutputsError, match=r"^json is not valid JSON: maximum recursion") as exc:
        StructuredOutputsParams(json=deep)
    assert exc.value.param == "json"
    schema: dict = {}
    for _ in range(100_000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(StructuredOutputsError, match=r"^json is nested too deeply$"):
        StructuredOutputsParams(json=schema)


def test_the_size_bound_is_inclusive():
    assert StructuredOutputsParams(regex="a" * MAX_CONSTRAINT_BYTES).regex


@pytest.mark.parametrize(
    ("kind", "text", "reason"),
    [
        ("grammar", "root ::= root", "no token can start it"),  # GBNF, no terminating derivation
        ("grammar", "start: start", "no token can start it"),
        ("regex", r"[^\s\S]", "no token can start it"),  # matches nothing
        ("regex", "a{1000000}", "lexer error: too many expressions constructed"),
        ("regex", "((a{100}){100}){100}", "lexer error: too many expressions constructed"),
        ("grammar", 'start: "a" start', "parser error: Too many items (limit 50000; ff_tokens)"),
    ],
)
def test_a_grammar_that_can_produce_no_output_does_not_compile(compiler, kind, text, reason):
    with pytest.raises(GrammarError) as exc:
        compiler.compile(StructuredOutputsParams(**{kind: text})).result()
    message = str(exc.value)
    assert message.startswith(f"{kind}: the grammar can produce no output ({reason}")
    assert "\n" not in message and "<state>" not in message


@pytest.mark.parametrize(
    ("kind", "text", "output"),
    [
        ("regex", "a{0}", ""),
        ("grammar", 'start: ""', ""),
        ("regex", "a{3}", "aaa"),
        ("grammar", 'start: "a"+', "aa"),
    ],
)
def test_grammars_with_an_output_still_compile(compiler, tokenizer, kind, text, output):
    assert walk(compiler, tokenizer, StructuredOutputsParams(**{kind: text}), output)


def test_choices_match_exactly_their_strings(compiler, tokenizer):
    choices = ["a.b", "(x)|y", r"\d", "#&-~", "[1]{2}", "^$", "é ü", "a\nb", "*+?"]
    spec = StructuredOutputsParams(choice=choices)
    for choice in choices:
        assert walk(compiler, tokenizer, spec, choice), choice
    for other in ("axb", "x", "y", "1", "11", "", "é", "a"):
        assert not walk(compiler, tokenizer, spec, other), other


def test_thousands_of_choices_are_followed(compiler, tokenizer):
    # a Lark rule of 3,000 literals compiled, then refused the first token: 3,001 items in a row, past
    # llguidance's 2,000
    spec = StructuredOutputsParams(choice=[f"option-{i}" for i in range(3000)])
    assert walk(compiler, tokenizer, spec, "option-2999")
    assert not walk(compiler, tokenizer, spec, "option-3000")


def test_a_deep_rule_chain_compiles_on_the_compile_threads(compiler, tokenizer):
    # 8,000 levels of rules: a segmentation fault of the whole process on an 8 MiB thread stack
    depth = 8000
    rules = "\n".join(f'a{i}: "a" a{i + 1}' for i in range(depth))
    spec = StructuredOutputsParams(grammar=f'start: a0\n{rules}\na{depth}: "z"')
    assert walk(compiler, tokenizer, spec, "a" * depth + "z")


def test_a_host_that_refuses_the_deep_stack_still_compiles(tokenizer, monkeypatch, caplog):
    # 64 TiB of stack cannot be mapped: the compile threads could not start, nor the engine
    monkeypatch.setattr(compiler_module, "COMPILE_STACK_BYTES", 1 << 46)
    with caplog.at_level(logging.WARNING, logger=compiler_module.__name__):
        c = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    try:
        assert c.compile(StructuredOutputsParams(regex="a{3}")).result().kind == "regex"
    finally:
        c.close()
    assert "grammar compile threads keep the default stack" in caplog.records[0].getMessage()


def test_a_panic_inside_llguidance_is_logged_not_passed_on(caplog):
    panic = "panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n<backtrace>\n  0: <?>"
    with caplog.at_level(logging.WARNING, logger=grammar.__name__):
        message = grammar._client_message(panic, "choice")
    assert message == "the grammar is too large or complex to compile"
    (record,) = caplog.records
    assert "u16::MAX" in record.getMessage() and record.levelno == logging.WARNING


def test_a_grammar_that_makes_llguidance_panic_is_a_short_grammar_error(compiler, caplog):
    # ~80,000 symbols: past llguidance's assertion (~65,000), under its size limit (100,000); its panic
    # text and backtrace were the 400's message
    rules = "\n".join(f'a{i}:"a"a{i + 1}' for i in range(40_000))
    spec = StructuredOutputsParams(grammar=f'start: a0\n{rules}\na40000:"z"')
    with caplog.at_level(logging.WARNING, logger=grammar.__name__), pytest.raises(GrammarError) as exc:
        compiler.compile(spec).result()
    assert str(exc.value) == "grammar: the grammar is too large or complex to compile"
    assert "grammar.symbols.len() < u16::MAX" in caplog.records[0].getMessage()


def test_a_panic_converting_a_constraint_is_a_short_grammar_error(monkeypatch, caplog):
    class PanicException(BaseException):  # pyo3's, which llguidance raises when Rust panics
        pass

    def panics(*args, **kwargs):
        raise PanicException("index out of bounds\n<backtrace>\n  0: <?>")

    monkeypatch.setattr(grammar.llguidance.LLMatcher, "grammar_from_regex", panics)
    with caplog.at_level(logging.WARNING, logger=grammar.__name__), pytest.raises(GrammarError) as exc:
        grammar.grammar_text(StructuredOutputsParams(regex="a"))
    assert str(exc.value) == "regex: the grammar is too large or complex to compile"
    assert "index out of bounds" in caplog.records[0].getMessage()


def test_llguidance_errors_are_one_line_of_bounded_length():
    assert grammar._client_message("lexer error: x\n<state>\nTokens: ...", "regex") == "lexer error: x"
    long = grammar._client_message("e" * 1000, "regex")
    assert len(long) == 300 and long.endswith("...")


def test_two_compile_pools_made_at_once_leave_the_default_stack_size(monkeypatch):
    """The stack size is process-wide. Pool A sets 512 MiB, pool B (another engine built on another thread)
    sets it too and reads 512 MiB as its previous value; A restores the default, then B restores 512 MiB:
    every later thread of the process had a 512 MiB stack (141 of 200 racing trials did before). Held in
    A's window, B must wait for A instead of entering its own."""
    original = threading.stack_size()
    in_window = {"A": threading.Event(), "B": threading.Event()}
    release = {"A": threading.Event(), "B": threading.Event()}
    b_at_lock = threading.Event()

    class Gated(ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):  # the first submit of a pool is inside its window
            name = threading.current_thread().name
            if name in in_window and not in_window[name].is_set():
                in_window[name].set()
                release[name].wait()
            return super().submit(fn, *args, **kwargs)

    class SeenLock:
        def __init__(self) -> None:
            self._lock = threading.Lock()

        def __enter__(self) -> None:
            if threading.current_thread().name == "B":
                b_at_lock.set()
            self._lock.acquire()

        def __exit__(self, *exc: object) -> None:
            self._lock.release()

    monkeypatch.setattr(compiler_module, "ThreadPoolExecutor", Gated)
    monkeypatch.setattr(compiler_module, "_STACK_SIZE_LOCK", SeenLock(), raising=False)
    pools: list[ThreadPoolExecutor] = []
    threads = {n: threading.Thread(target=lambda: pools.append(_deep_stack_pool(1)), name=n) for n in "AB"}
    try:
        threads["A"].start()
        wait_until(in_window["A"].is_set, what="pool A inside its stack-size window")
        threads["B"].start()
        wait_until(lambda: in_window["B"].is_set() or b_at_lock.is_set(), what="pool B at its window")
        release["A"].set()
        threads["A"].join()
        release["B"].set()
        threads["B"].join()
        assert threading.stack_size() == original
    finally:
        for event in release.values():
            event.set()
        for pool in pools:
            pool.shutdown()
        threading.stack_size(original)
