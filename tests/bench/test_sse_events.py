"""Turning timestamped SSE payloads into a record, and building request bodies."""

from __future__ import annotations

import json

import pytest

from kvpilot.bench.config import EndpointConfig
from kvpilot.bench.records import PHASE_MEASURED, RequestRecord
from kvpilot.bench.sse_client import OpenAIStreamClient, _apply_events, _Failure
from kvpilot.bench.workloads import RequestSpec


def _blank() -> RequestRecord:
    return RequestRecord(
        index=0, phase=PHASE_MEASURED, prompt_words=3, max_tokens=4, scheduled_s=0.0, sent_s=0.0
    )


def _events(*pairs: tuple[float, dict | str]) -> list[tuple[float, bytes]]:
    return [(t, (p if isinstance(p, str) else json.dumps(p)).encode()) for t, p in pairs]


def test_chat_role_event_is_not_a_token_and_usage_wins_over_chunk_count():
    record = _blank()
    _apply_events(
        record,
        _events(
            (0.25, {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}),
            (0.5, {"choices": [{"index": 0, "delta": {"content": "Hello"}}]}),
            (0.75, {"choices": [{"index": 0, "delta": {"content": ""}}]}),
            (1.0, {"choices": [{"index": 0, "delta": {"content": " world"}, "finish_reason": "length"}]}),
            (1.25, {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}}),
        ),
        chat=True,
    )
    assert record.emit_s == [0.5, 1.0]
    assert (record.usage_prompt_tokens, record.usage_output_tokens) == (7, 5)
    assert record.output_tokens == 5 and record.output_token_source == "usage"
    assert record.tpot_s == 0.125  # (1.0 − 0.5) / (5 − 1)
    assert record.finish_reason == "length"


def test_completion_chunks_are_counted_without_usage():
    record = _blank()
    _apply_events(
        record,
        _events(
            (0.5, {"choices": [{"text": "a"}]}),
            (0.5, {"choices": [{"text": "b"}]}),
            (0.75, {"choices": [{"text": "c"}]}),
        ),
        chat=False,
    )
    assert record.emit_s == [0.5, 0.5, 0.75]  # two events in one network read share its timestamp
    assert (record.output_tokens, record.output_token_source) == (3, "chunks")
    assert record.itl_s == [0.0, 0.25]


@pytest.mark.parametrize(
    ("payload", "error_type", "detail"),
    [
        ("not json", "invalid_response", "unparsable event"),
        ('["a list"]', "invalid_response", "not a JSON object"),
        ('{"error": {"message": "boom"}}', "invalid_response", "error in stream"),
        ('{"choices": [{"text": ""}]}', "empty_output", "without output text"),
    ],
)
def test_bad_streams_end_with_a_typed_error(payload, error_type, detail):
    with pytest.raises(_Failure) as failure:
        _apply_events(_blank(), [(0.5, payload.encode())], chat=False)
    assert failure.value.error_type == error_type
    assert detail in failure.value.detail


def test_payload_carries_model_lengths_tenant_and_optional_vllm_params():
    spec = RequestSpec(
        index=0, prompt="hi there", max_tokens=7, prompt_words=5, system_prompt="be brief", tenant="tenant-1"
    )
    chat = OpenAIStreamClient(
        None, EndpointConfig(api="chat", ignore_eos=True, min_tokens_equal_max=True), "m"
    )
    assert chat.payload(spec) == {
        "model": "m",
        "max_tokens": 7,
        "stream": True,
        "temperature": 0.0,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}],
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "min_tokens": 7,
        "user": "tenant-1",
    }
    plain = OpenAIStreamClient(None, EndpointConfig(include_usage=False), "m")
    assert plain.payload(spec) == {
        "model": "m",
        "max_tokens": 7,
        "stream": True,
        "temperature": 0.0,
        "prompt": "be brief\n\nhi there",
        "user": "tenant-1",
    }
