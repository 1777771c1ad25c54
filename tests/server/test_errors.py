"""Bad input never gets a 500: every client mistake is an OpenAI error object with the right status, code
and param (400, 401, 404, 405, 413 here; 429 and 503 in test_admission_limits.py and test_lifecycle.py)."""

from __future__ import annotations

import httpx
import openai
import pytest
from raw_http import MALFORMED, error_of, exchange

pytestmark = pytest.mark.e2e
MODEL = "tiny-random"
CHAT = [{"role": "user", "content": "hi"}]


def _error(exc: pytest.ExceptionInfo) -> tuple[int, str | None, str | None]:
    return exc.value.status_code, exc.value.code, exc.value.param


@pytest.mark.parametrize(
    ("kwargs", "code", "param"),
    [
        ({"temperature": -1.0}, "invalid_request", "temperature"),
        ({"top_p": 0.0}, "invalid_request", "top_p"),
        ({"n": 0}, "invalid_request", "n"),
        ({"n": 65}, "invalid_request", "n"),  # more samples than the server's max_num_seqs (64)
        ({"n": 2, "best_of": 65}, "invalid_request", "best_of"),
        ({"max_tokens": 0}, "invalid_request", "max_tokens"),
        ({"max_tokens": 600}, "context_length_exceeded", "max_tokens"),
        ({"logprobs": 21}, "invalid_request", "logprobs"),
        # the engine's own limits name their field ("prompt" matched prompt_logprobs' message before)
        ({"extra_body": {"prompt_logprobs": 21}}, "invalid_request", "prompt_logprobs"),
        ({"extra_body": {"stop_token_ids": [100000]}}, "invalid_request", "stop_token_ids"),
        ({"extra_body": {"allowed_token_ids": [100000]}}, "invalid_request", "allowed_token_ids"),
        ({"logit_bias": {"100000": 1.0}}, "invalid_request", "logit_bias"),
        ({"logprobs": 2, "extra_body": {"use_beam_search": True}, "n": 2}, "invalid_request", "logprobs"),
        ({"stream": True, "best_of": 3}, "invalid_request", "stream"),
        ({"prompt": [100000]}, "invalid_request", "prompt"),
        ({"prompt": [7] * 600}, "context_length_exceeded", "prompt"),
        ({"prompt": []}, "invalid_request", "prompt"),
        ({"logit_bias": {"abc": 1.0}}, "invalid_request", "logit_bias"),
        ({"extra_body": {"max_tokens": "5"}}, "invalid_request", "max_tokens"),
        ({"extra_body": {"top_k": -5}}, "invalid_request", "top_k"),
        ({"extra_body": {"seed": 1 << 70}}, "invalid_request", "seed"),
        ({"extra_body": {"stream_options": {"include_usage": True}}}, "invalid_request", "stream_options"),
        ({"suffix": "tail"}, "invalid_request", "suffix"),
    ],
)
def test_completion_400s(client, kwargs, code, param):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(**body)
    assert _error(exc) == (400, code, param)
    assert exc.value.type == "invalid_request_error"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"messages": [{"role": "robot", "content": "beep"}]}, "messages"),  # the template refuses the role
        ({"messages": []}, "messages"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"tool_choice": "required"}, "tool_choice"),  # nothing to call
        ({"extra_body": {"chat_template_kwargs": {"add_generation_prompt": False}}}, "chat_template_kwargs"),
    ],
)
def test_chat_400s(client, kwargs, param):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(**body)
    assert (exc.value.status_code, exc.value.param) == (400, param)


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"prompt": "x", "max_tokens": 2', None),  # truncated JSON
        (b'{"prompt": "x", "temperature": NaN}', "temperature"),
        (b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),  # a lone surrogate
        (b"[1, 2]", None),
        (b'{"max_tokens": 2}', "prompt"),
    ],
)
def test_malformed_bodies_are_400(tiny_server, raw, param):
    r = httpx.post(
        tiny_server.url + "/v1/completions",
        content=raw,
        headers={**tiny_server.headers, "content-type": "application/json"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == param


def test_bad_tenant_header_is_400(tiny_server):
    r = tiny_server.post("/v1/completions", {"prompt": "x", "max_tokens": 1}, headers={"x-tenant": "t" * 200})
    error = r.json()["error"]
    assert (r.status_code, error["code"], error["param"]) == (400, "invalid_tenant", "x-tenant")


def test_401_without_or_with_a_wrong_key(tiny_server):
    for key in ("wrong-key", ""):
        client = openai.OpenAI(
            base_url=tiny_server.url + "/v1",
            api_key=key or "x",
            max_retries=0,
            default_headers={} if key else {"Authorization": ""},
        )
        with pytest.raises(openai.AuthenticationError) as exc:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert (exc.value.status_code, exc.value.code) == (401, "invalid_api_key")
    assert httpx.get(tiny_server.url + "/health").status_code == 200  # probes need no key
    assert httpx.get(tiny_server.url + "/v1/models").status_code == 401


def test_404_unknown_model_and_route(client, tiny_server):
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert (exc.value.code, exc.value.param) == ("model_not_found", "model")
    r = tiny_server.get("/v1/nothing-here")
    assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found")
    r = tiny_server.get("/v1/completions")
    assert (r.status_code, r.json()["error"]["code"]) == (405, "method_not_allowed")


def test_413_body_too_large(client, tiny_server):
    with pytest.raises(openai.APIStatusError) as exc:
        client.completions.create(model=MODEL, prompt="x" * 70_000, max_tokens=1)
    assert (exc.value.status_code, exc.value.code) == (413, "request_too_large")
    # a chunked body (no Content-Length) is cut off at the limit too
    r = httpx.post(
        tiny_server.url + "/v1/completions",
        content=iter([b'{"prompt": "', b"y" * 70_000, b'"}']),
        headers={**tiny_server.headers, "content-type": "application/json"},
    )
    assert r.status_code == 413


def test_rejections_are_counted_by_reason(tiny_server):
    def rejected(reason: str) -> float:
        prefix = f'kvpilot_requests_rejected_total{{model_name="{MODEL}",reason="{reason}"}} '
        lines = tiny_server.get("/metrics").text.splitlines()
        line = next((li for li in lines if li.startswith(prefix)), None)
        return float(line.rsplit(" ", 1)[1]) if line else 0.0

    before = rejected("model_not_found")
    tiny_server.post("/v1/completions", {"model": "nope", "prompt": "x"})
    assert rejected("model_not_found") == before + 1


def test_a_wrong_type_names_the_field_not_the_union_member(tiny_server):
    r = tiny_server.post("/v1/completions", {"prompt": 5})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "prompt")


def test_a_too_long_list_is_told_so_not_that_it_is_not_a_string(tiny_server):
    r = tiny_server.post("/v1/completions", {"prompt": "x", "max_tokens": 1, "stop": ["s"] * 65})
    error = r.json()["error"]
    assert (r.status_code, error["param"]) == (400, "stop")
    assert "at most" in error["message"] and "valid string" not in error["message"], error["message"]


def test_a_form_body_is_told_to_send_json(tiny_server):
    """curl -d without a Content-Type header sends a form: the message said "Input should be a valid
    dictionary or object to extract fields from"."""
    r = httpx.post(tiny_server.url + "/v1/completions", data={"prompt": "x"}, headers=tiny_server.headers)
    assert r.status_code == 400
    assert "Content-Type: application/json" in r.json()["error"]["message"]


@pytest.mark.parametrize("request_bytes", MALFORMED)
def test_security_a_request_uvicorn_cannot_parse_gets_an_openai_json_400(tiny_server, request_bytes):
    """uvicorn's own answer is a plain-text 400; the server's protocol class writes the same JSON error as
    every other (and closes the connection)."""
    status, headers, body = exchange(tiny_server.url, request_bytes)  # read until the server closes
    assert (status, headers["content-type"], headers["connection"]) == (400, "application/json", "close")
    error = error_of(body)
    assert (error["code"], error["type"]) == ("invalid_http_request", "invalid_request_error")
    assert int(headers["content-length"]) == len(body)


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty"])
def test_a_sampling_value_past_float32_is_400_and_the_largest_float32_is_served(tiny_server, field):
    """vLLM bounds these two only below; the sampler computes in float32, where 1e308 became inf (a
    RuntimeWarning on the engine thread, and -inf/inf a NaN logit)."""
    r = tiny_server.post("/v1/completions", {"prompt": "x", "max_tokens": 2, field: 1e308})
    low = ">= 0" if field == "temperature" else "> 0"
    assert (r.status_code, r.json()) == (
        400,
        {
            "error": {
                "message": f"{field} must be {low} and <= 3.4028235e+38 (float32), got 1e+308",
                "type": "invalid_request_error",
                "param": field,
                "code": "invalid_request",
            }
        },
    )
    largest = {"prompt": "x", "max_tokens": 2, "allowed_token_ids": [5, 6], field: 3.4028234663852886e38}
    r = tiny_server.post("/v1/completions", largest)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert "RuntimeWarning" not in tiny_server.log_path.read_text()
