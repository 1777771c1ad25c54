"""Structured outputs and tool calls on the bundled SmolLM2-135M through the official client (slow: the
real model; docs/architecture.md#structured-outputs). The tiny-model tests hold the mechanics exactly;
these show a real model's answers under the constraints: a schema-valid record that carries the prompt's
facts, and a forced call to the right function whose streamed pieces join into the non-streamed call."""

from __future__ import annotations

import json

import jsonschema
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "species": {"enum": ["cat", "dog"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
    },
    "required": ["name", "species", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def client(start_process, smollm2_dir):
    args = ["--model", "smollm2-135m", "--served-model-name", "smollm2", "--warmup-buckets", "1x16"]
    return start_process(args).client()


def test_a_record_under_a_schema(client):
    ask = [{"role": "user", "content": "Give me a JSON record for a cat named Tom who is 3 years old."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
    out = client.chat.completions.create(
        model="smollm2", messages=ask, max_tokens=120, temperature=0, response_format=fmt
    )
    record = json.loads(out.choices[0].message.content)
    jsonschema.validate(record, PET)
    assert (record["species"], record["age"], out.choices[0].finish_reason) == ("cat", 3, "stop")
    free = client.chat.completions.create(model="smollm2", messages=ask, max_tokens=120, temperature=0)
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(free.choices[0].message.content), PET)


def test_a_forced_call_streams_as_it_returns(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = {
        "model": "smollm2",
        "messages": ask,
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 80,
        "temperature": 0,
    }
    out = client.chat.completions.create(**kwargs)
    (call,) = out.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert out.choices[0].finish_reason == "tool_calls"
    pieces, names = "", []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for tc in chunk.choices[0].delta.tool_calls or []:
            names += [tc.function.name] if tc.id else []
            pieces += tc.function.arguments or ""
    assert (names, pieces) == (["get_weather"], call.function.arguments)
