"""Tool calling without a server: the tool-call parsers (streamed pieces join into the whole-text parse,
whatever the chunking), the prompt rewrite for templates without tools, and the grammar of forced calls
(docs/architecture.md#structured-outputs)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvpilot.engine.prompt_render import render_chat_prompt
from kvpilot.engine.server.tool_calls import ToolChoice, call_grammar, function_schemas
from kvpilot.engine.server.tool_parsers import ToolCallStream, assemble, parse_tool_calls
from kvpilot.engine.structured.compiler import GrammarCompiler
from kvpilot.engine.tokenizer import Tokenizer
from kvpilot.engine.tool_prompt import HERMES, LLAMA3_JSON, prepare_tool_messages, tool_call_format

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
HERMES_TEXTS = {
    "one call": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"x": "}"}]}}'
        "\n</tool_call>",
        None,
        [("get_weather", '{"city": "Paris", "n": [1, {"x": "}"}]}')],
    ),
    "text then two calls": (
        'Checking.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"q": "x\\"y"}}\n</tool_call>',
        "Checking.\n\n",
        [("a", "{}"), ("b", '{"q": "x\\"y"}')],
    ),
    "SmolLM2's list": (
        '<tool_call>[{"name": "a", "arguments": {"k": 1}}, {"name": "b", "arguments": {}}]</tool_call>',
        None,
        [("a", '{"k": 1}'), ("b", "{}")],
    ),
    "plain text with a lookalike": ("x < y and <tool thing", "x < y and <tool thing", []),
    "a block that is not a call": (
        "<tool_call>not json</tool_call> after",
        "<tool_call>not json</tool_call> after",
        [],
    ),
    "cut off mid-arguments": ('<tool_call>\n{"name": "a", "arguments": {"k": 1', None, [("a", '{"k": 1')]),
    "name after arguments": (
        '<tool_call>{"arguments": {"z": 2}, "name": "late"}</tool_call>',
        None,
        [("late", '{"z": 2}')],
    ),
    "arguments as a JSON string": (
        '<tool_call>{"name": "s", "arguments": "{\\"a\\": 1}"}</tool_call>',
        None,
        [("s", '{"a": 1}')],
    ),
    "no arguments": ('<tool_call>{"name": "noargs"}</tool_call>', None, [("noargs", "{}")]),
    # a stream sent '{"a": 1}' and then the tail of a later arguments key, joining into invalid JSON
    "a second arguments key": (
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}, "parameters": {"bbbbbbbb": 2}}\n</tool_call>',
        None,
        [("f", '{"a": 1}')],
    ),
    # the close tag inside a string ended the block there, in the stream and in the whole parse
    "a close tag inside a string": (
        '<tool_call>\n{"name": "f", "arguments": {"x": "</tool_call>"}}\n</tool_call> done',
        " done",
        [("f", '{"x": "</tool_call>"}')],
    ),
    "an unclosed string in a block that is not a call": (
        '<tool_call>say "hi</tool_call> then',
        '<tool_call>say "hi</tool_call> then',
        [],
    ),
}


def calls_of(tool_calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in tool_calls]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_TEXTS.values(), ids=list(HERMES_TEXTS))
def test_hermes_parse(text, content, calls):
    parsed = parse_tool_calls(text, HERMES)
    assert (parsed.content, calls_of(parsed.tool_calls)) == (content, calls)
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in parsed.tool_calls)


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_TEXTS.values(), ids=list(HERMES_TEXTS))
def test_any_chunking_streams_into_the_whole_parse(text, content, calls):
    for seed in range(25):
        rnd = random.Random(seed)
        stream, streamed, deltas, i = ToolCallStream(HERMES), "", [], 0
        while i < len(text):
            n = rnd.randint(1, 7)
            piece, new = stream.push(text[i : i + n])
            streamed, deltas, i = streamed + piece, deltas + new, i + n
        piece, new = stream.finish()
        streamed, deltas = streamed + piece, deltas + new
        assert ((streamed or None), calls_of(assemble(deltas))) == (content, calls)
        first = [d for d in deltas if d.id is not None]
        assert all(d.arguments == "" for d in first)  # a call's first delta: id, name, arguments ""


def test_llama3_json_calls_or_content():
    text = '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'
    assert calls_of(parse_tool_calls(text, LLAMA3_JSON).tool_calls) == [("f", '{"a": 1}'), ("g", "{}")]
    plain = parse_tool_calls('The answer is {"name"}', LLAMA3_JSON)
    assert (plain.content, plain.tool_calls) == ('The answer is {"name"}', [])


def test_the_format_follows_the_template():
    assert tool_call_format("{% if message.role == 'ipython' %}<|python_tag|>{% endif %}") == LLAMA3_JSON
    assert tool_call_format("{{ '<tool_call>' }}") == HERMES and tool_call_format(None) == HERMES


# ---- the prompt ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}
TURNS = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
]


def test_a_template_without_tools_gets_them_in_the_hermes_convention(tokenizer: Tokenizer):
    text = render_chat_prompt(tokenizer, TURNS, tools=[WEATHER])
    system, rest = text.split("<|im_end|>", 1)
    assert system.startswith("<|im_start|>system\n# Tools") and json.dumps(WEATHER) in system
    assert (
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in rest
    )
    assert (
        "<|im_start|>user\n<tool_response>\n-3 C\n</tool_response><|im_end|>" in rest
    )  # the template has no tool role


def test_a_system_message_keeps_its_text_before_the_tools():
    out = prepare_tool_messages(None, [{"role": "system", "content": "Be brief."}, TURNS[0]], [WEATHER])
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and out[1] == TURNS[0]


def test_a_template_with_tools_gets_the_conversation_as_sent():
    template = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ m.tool_calls }}{% endif %}{% endfor %}{{ tools }}"
    )
    assert prepare_tool_messages(template, TURNS, [WEATHER]) is TURNS


# ---- forced calls --------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
def test_forced_call_grammar_takes_a_call_and_nothing_else(tokenizer: Tokenizer, fmt: str):
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    functions = function_schemas([WEATHER, {"type": "function", "function": {"name": "noop"}}])
    key = "arguments" if fmt == HERMES else "parameters"

    def accepts(spec, text: str) -> bool:
        m = compiler.matcher(spec)
        return (
            all(m.accept(t) for t in tokenizer.encode(text, add_special_tokens=False)) and m.ll.is_accepting()
        )

    def wrap(call: str) -> str:
        return f"<tool_call>\n{call}\n</tool_call>" if fmt == HERMES else call

    weather = wrap(f'{{"name": "get_weather", "{key}": {{"city": "Rome"}}}}')
    noop = wrap(f'{{"name": "noop", "{key}": {{}}}}')
    joiner = "\n" if fmt == HERMES else "; "
    required = call_grammar(ToolChoice("required"), functions, fmt, parallel=True)
    assert (
        accepts(required, weather) and accepts(required, noop) and accepts(required, weather + joiner + noop)
    )
    assert not accepts(required, "Sure!") and not accepts(
        required, wrap(f'{{"name": "other", "{key}": {{}}}}')
    )
    single = call_grammar(ToolChoice("required"), functions, fmt, parallel=False)
    assert not accepts(single, weather + joiner + noop)
    named = call_grammar(ToolChoice("named", "get_weather"), functions, fmt, parallel=True)
    assert accepts(named, weather) and not accepts(named, noop)
    assert not accepts(named, wrap(f'{{"name": "get_weather", "{key}": {{}}}}'))  # city is required
    assert call_grammar(ToolChoice("auto"), functions, fmt, parallel=True) is None
    compiler.close()
