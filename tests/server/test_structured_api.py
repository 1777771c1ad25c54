"""Structured outputs and tool calls on a live ``kvpilot serve`` (tiny model, subprocess), driven by the
official ``openai`` client (docs/architecture.md#structured-outputs). Greedy, so every output is exact; each
constraint is checked against the same request unconstrained (the negative control). The module runs its
own server without the native C kernels: nothing here depends on them, so it never waits for their build."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.e2e
MODEL = "tiny-random"
MESSAGES = [{"role": "user", "content": "Give me a record."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99},
        "kind": {"enum": ["a", "bb"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,3}$"}, "maxItems": 2},
    },
    "required": ["id", "kind", "tags"],
    "additionalProperties": False,
}
RECORD_FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["a"],
            "additionalProperties": False,
        },
    },
}
TOOL_G = {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {}}}}
SHORT = [{"role": "user", "content": "a?"}]  # the tools' section fills most of the tiny model's 512 tokens


@pytest.fixture(scope="module")
def server(start_process):
    args = ["--model", MODEL, "--num-kv-blocks", "512", "--warmup-buckets", "1x8", "--native-cpu-ops", "off"]
    return start_process(args)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def valid(text: str | None, schema: dict = SCHEMA) -> bool:
    try:
        jsonschema.validate(json.loads(text or ""), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL, **{"temperature": 0, **kwargs})


def test_json_schema_on_chat_validates_and_streams_the_same(client):
    out = chat(client, messages=MESSAGES, max_tokens=300, response_format=RECORD_FORMAT)
    (choice,) = out.choices
    assert valid(choice.message.content), choice.message.content
    assert choice.finish_reason == "stop"
    chunks = list(chat(client, messages=MESSAGES, max_tokens=300, response_format=RECORD_FORMAT, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert not valid(chat(client, messages=MESSAGES, max_tokens=60).choices[0].message.content)


def test_sampled_choices_all_validate(client):
    out = chat(
        client, messages=MESSAGES, max_tokens=300, response_format=RECORD_FORMAT, n=3, temperature=1.0, seed=4
    )
    assert len(out.choices) == 3 and all(valid(c.message.content) for c in out.choices)


def test_json_object_on_completions(client):
    bias = {"126": 5.0, "37": 5.0}  # '{' and '"' of the tiny vocabulary: strings and the object close soon
    fmt = {"type": "json_object"}
    out = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=300,
        temperature=0,
        logit_bias=bias,
        extra_body={"response_format": fmt},
    )
    assert isinstance(json.loads(out.choices[0].text), dict) and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-c]+"}}, lambda t: re.fullmatch("[0-9]{3}-[a-c]+", t)),
        ({"guided_regex": "(yes|no)!"}, lambda t: t in ("yes!", "no!")),
        ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
        ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
        ({"guided_json": SCHEMA}, valid),
        (
            {"structured_outputs": {"grammar": 'start: "ab" | "cd" "e"*'}},
            lambda t: re.fullmatch("ab|cde*", t),
        ),
    ],
)
def test_vllm_extras_on_completions(client, extra, check):
    out = client.completions.create(
        model=MODEL, prompt="The answer:", max_tokens=300, temperature=0, extra_body=extra
    )
    assert check(out.choices[0].text), out.choices[0].text
    free = client.completions.create(model=MODEL, prompt="The answer:", max_tokens=12, temperature=0)
    assert not check(free.choices[0].text)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "uniqueItems",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
            "not",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        # the schema false accepts nothing: a 400, where it raised StopIteration / an uncaught error (500)
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}},
            "response_format.json_schema.schema",
        ),
        ({"guided_json": "false"}, "guided_json"),
        ({"structured_outputs": {"json": False}}, "structured_outputs.json"),
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_json": {"type": "object"}, "use_beam_search": True, "n": 2}, "structured_outputs"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)
    assert (exc.value.status_code, exc.value.param) == (400, param)


BIG_SCHEMA = {"type": "object", "description": "d" * (1 << 20)}


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        (
            {"guided_choice": [f"c{i}" for i in range(10_001)]},
            "guided_choice",
            "guided_choice: choice lists 10001 strings; at most 10000 are allowed",
        ),
        (
            {"structured_outputs": {"regex": "a" * ((1 << 20) + 1)}},
            "structured_outputs.regex",
            "structured_outputs: regex is 1048577 bytes; constraints may be at most 1048576 bytes (1 MiB)",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BIG_SCHEMA}}},
            "response_format.json_schema.schema",
            "response_format.json_schema.schema: json is 1048613 bytes; constraints may be at most",
        ),
        (
            {"guided_grammar": "root ::= root"},
            "guided_grammar",
            "guided_grammar: grammar: the grammar can produce no output (no token can start it)",
        ),
        (
            {"structured_outputs": {"grammar": "start: start"}},
            "structured_outputs.grammar",
            "structured_outputs.grammar: grammar: the grammar can produce no output (no token can start it)",
        ),
        (
            {"guided_regex": r"[^\s\S]"},
            "guided_regex",
            "guided_regex: regex: the grammar can produce no output (no token can start it)",
        ),
        (
            {"guided_regex": "a{1000000}"},
            "guided_regex",
            "guided_regex: regex: the grammar can produce no output (lexer error: too many expressions",
        ),
        (
            {"guided_regex": "((a{100}){100}){100}"},
            "guided_regex",
            "guided_regex: regex: the grammar can produce no output (lexer error: too many expressions",
        ),
        (  # ~80,000 symbols: llguidance panics; its text and backtrace were the message
            {
                "guided_grammar": "start: a0\n"
                + "".join(f'a{i}:"a"a{i + 1}\n' for i in range(40_000))
                + 'a40000:"z"'
            },
            "guided_grammar",
            "guided_grammar: grammar: the grammar is too large or complex to compile",
        ),
        (  # a RecursionError out of json.loads: a 500 before
            {"guided_json": '{"type": "array", "items": ' * 100_000 + "{}" + "}" * 100_000},
            "guided_json",
            "guided_json: json is not valid JSON: maximum recursion depth exceeded",
        ),
    ],
    ids=[
        "choices",
        "bytes",
        "schema-bytes",
        "root-root",
        "start-start",
        "empty-class",
        "a1e6",
        "nested",
        "panic",
        "deep",
    ],
)
def test_hostile_constraints_are_short_400s(server, extra, param, message):
    # before: the choices compiled for minutes, then a 400 carrying llguidance's panic and backtrace; the
    # impossible grammars were 200s with no text (or "a") and finish_reason "error"
    with httpx.Client(base_url=server.url, timeout=120) as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4, **extra})
        assert r.status_code == 400, r.text[:300]
        error = r.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", param)
        assert error["message"].startswith(message), error["message"]
        assert "\n" not in error["message"] and "backtrace" not in error["message"]
        assert http.get("/health").status_code == 200


def _reassemble(chunks) -> tuple[str | None, list[tuple[str, str, str]], str | None]:
    content, calls, finish = "", [], None
    for chunk in chunks:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            if tc.id is not None:
                assert tc.index == len(calls) and tc.type == "function" and tc.function.arguments == ""
                calls.append([tc.id, tc.function.name, ""])
            calls[tc.index][2] += tc.function.arguments or ""
        finish = choice.finish_reason or finish
    return content or None, [tuple(c) for c in calls], finish


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "f"}}], ids=["required", "named"]
)
def test_forced_tool_calls_stream_as_they_return(client, tool_choice):
    kwargs = {"messages": SHORT, "tools": [TOOL, TOOL_G], "tool_choice": tool_choice, "max_tokens": 78}
    out = chat(client, parallel_tool_calls=False, **kwargs)
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name in ("f", "g") if tool_choice == "required" else call.function.name == "f"
    params = {"f": TOOL, "g": TOOL_G}[call.function.name]["function"]["parameters"]
    assert valid(call.function.arguments, params), call.function.arguments
    content, calls, finish = _reassemble(chat(client, parallel_tool_calls=False, stream=True, **kwargs))
    assert (content, finish) == (None, "tool_calls")
    assert [(name, args) for _, name, args in calls] == [(call.function.name, call.function.arguments)]
    free = chat(client, messages=SHORT, tools=[TOOL, TOOL_G], tool_choice="auto", max_tokens=40)
    assert free.choices[0].finish_reason != "tool_calls" and not free.choices[0].message.tool_calls


def test_tool_results_in_the_conversation(client, tiny_tokenizer):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 3}'}}
    messages = [
        *SHORT,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "7"},
    ]
    out = chat(client, messages=messages, tools=[TOOL], tool_choice="none", max_tokens=2)
    assert out.choices[0].message.tool_calls is None
    assert out.usage.prompt_tokens < 512


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": [TOOL, TOOL]}, "tools[1].function.name"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "u",
                            "parameters": {
                                "type": "object",
                                "properties": {"x": {"type": "array", "uniqueItems": True}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "uniqueItems",
        ),
        # the forced call's grammar past 1 MiB: a 500 (an uncaught StructuredOutputsError) before
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "big", "parameters": BIG_SCHEMA},
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_bad_tools_are_400(client, kwargs, param):
    body = {"messages": SHORT, "tools": [TOOL], "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, **body)
    assert (exc.value.status_code, exc.value.param) == (400, param)


def test_metrics_count_kinds_compiles_and_the_mask_cost(server, client):
    def scrape() -> dict[tuple[str, tuple], float]:
        text = httpx.get(server.url + "/metrics").text
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def value(metrics, name: str, **labels) -> float:
        return metrics.get((name, tuple(sorted({"model_name": MODEL, **labels}.items()))), 0.0)

    before = scrape()
    out = client.completions.create(
        model=MODEL, prompt="x", max_tokens=8, temperature=0, extra_body={"guided_regex": "[5-9]{3}q"}
    )
    assert out.choices[0].finish_reason == "stop" and len(out.choices[0].text) == 4
    after = scrape()
    kind = {"kind": "regex"}
    assert value(after, "kvpilot_structured_output_requests_total", **kind) == (
        value(before, "kvpilot_structured_output_requests_total", **kind) + 1
    )
    assert value(after, "kvpilot_grammar_compile_seconds_count", **kind) == (
        value(before, "kvpilot_grammar_compile_seconds_count", **kind) + 1
    )
    masked = value(after, "kvpilot_grammar_masked_tokens_total") - value(
        before, "kvpilot_grammar_masked_tokens_total"
    )
    assert masked == 4  # one per character: after the last the grammar is complete, so no step for EOS
    assert value(after, "kvpilot_grammar_mask_seconds_total") > value(
        before, "kvpilot_grammar_mask_seconds_total"
    )
