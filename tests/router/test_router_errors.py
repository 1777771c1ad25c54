"""The router's answers to bad input: a 4xx with an OpenAI error body (``{"error": {"message", "type",
"param", "code"}}``), never a 5xx nor aiohttp's plain-text pages; a body it cannot derive a prompt from is
routed without locality and gets the engine's own answer. Property tests fuzz every endpoint with arbitrary
JSON, arbitrary bytes, methods and paths, as the engine was fuzzed (tests/server/test_schemathesis.py)."""

from __future__ import annotations

import gzip
import json
import zlib
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from raw_http import MALFORMED, error_of, exchange_async

from kvpilot.router.proxy import REPLICA_HEADER
from kvpilot.router.request_profile import CHAT_COMPLETIONS, COMPLETIONS

ERROR_KEYS = {"message", "type", "param", "code"}
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
DEEP = 100_000


def sample(router, name: str, **labels: str) -> float:
    value = router.router.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def assert_openai_error(status: int, raw: bytes) -> dict[str, Any]:
    assert 400 <= status < 500, (status, raw[:300])
    body = json.loads(raw)
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert isinstance(body["error"]["message"], str) and isinstance(body["error"]["type"], str), body
    return body["error"]


async def answer(http, method: str, url: str, **kwargs: Any) -> tuple[int, bytes]:
    async with http.request(method, url, **kwargs) as response:
        return response.status, await response.read()


@pytest.fixture
async def router(fake_engines, routers):
    (engine,) = await fake_engines(1, token_delay_s=0.0)
    server = await routers([engine.url])
    server.engine = engine
    return server


@pytest.mark.parametrize(
    "raw", [b"[" * DEEP + b"]" * DEEP, b'{"prompt": ' + b'{"a": ' * DEEP + b"1" + b"}" * (DEEP + 1)]
)
async def test_security_a_100k_deep_body_is_a_400_not_a_500(router, http, raw: bytes) -> None:
    status, body = await answer(http, "POST", router.url + COMPLETIONS, data=raw)
    assert (status, json.loads(body)) == (
        400,
        {
            "error": {
                "message": "request body must be a JSON object: the body nests too deeply",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_json",
            }
        },
    )
    assert router.engine.received == []


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        (COMPLETIONS, b'{"prompt": "caf\\ud800 au lait", "max_tokens": 1}'),
        (CHAT_COMPLETIONS, b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1}'),
    ],
)
async def test_security_a_lone_surrogate_is_routed_without_locality_and_gets_the_engines_400(
    router, http, path, raw
) -> None:
    async with http.post(router.url + path, data=raw) as response:
        status, body, replica = response.status, await response.json(), response.headers[REPLICA_HEADER]
    # the fake engine's own refusal (the real engine says the field "contains invalid Unicode")
    assert (status, body, replica) == (
        400,
        {
            "error": {
                "message": "fake engine: TypeError",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_request",
            }
        },
        router.engine.url,
    )
    assert [p for p, _, _ in router.engine.received] == [path]
    assert sample(router, "kvpilot_router_decisions_total", policy="cache_aware", reason="fallback") == 1


async def test_security_token_ids_and_budgets_beyond_any_model_do_not_break_the_scoring(router, http) -> None:
    # a full block of ids beyond uint32 cannot be hashed: routed without locality, refused by the engine
    status, raw = await answer(http, "POST", router.url + COMPLETIONS, json={"prompt": [1 << 40] * 20})
    assert (status, json.loads(raw)["error"]["message"]) == (400, "fake engine: OverflowError")
    assert sample(router, "kvpilot_router_decisions_total", policy="cache_aware", reason="fallback") == 1
    # an output budget no float holds is scored as one beyond any KV cache
    status, raw = await answer(
        http, "POST", router.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 10**400, "n": 10**30}
    )
    assert (status, json.loads(raw)["usage"]["prompt_tokens"]) == (200, 1)
    assert sample(router, "kvpilot_router_decisions_total", policy="cache_aware", reason="fallback") == 2


async def test_a_router_bug_is_still_an_openai_error_body(router, http, monkeypatch) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(router.router.picker, "pick", broken)
    status, body = await answer(http, "POST", router.url + COMPLETIONS, json={"prompt": "hi"})
    assert (status, json.loads(body)) == (
        500,
        {
            "error": {
                "message": "internal router error",
                "type": "server_error",
                "param": None,
                "code": "internal_error",
            }
        },
    )


# --- fuzzing -----------------------------------------------------------------------------------------------

plain_text = st.text(max_size=40)
# a lone surrogate somewhere (json.dumps writes it as a \\udxxx escape, which Python's json reads back)
any_text = plain_text | st.tuples(plain_text, st.characters(categories=["Cs"]), plain_text).map("".join)
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(10**40), max_value=10**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | any_text
)
any_json = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=20,
)
role = st.sampled_from(["user", "system", "assistant"]) | any_json
message = st.fixed_dictionaries({"role": role, "content": any_text | any_json}) | st.fixed_dictionaries(
    {}, optional={"role": role, "content": any_json}
)
prompt = (
    any_text
    | st.lists(st.integers(min_value=-5, max_value=1 << 33), max_size=40)
    | st.lists(any_text, max_size=3)
    | any_json
)
# apply_chat_template's own parameter names among them: as template variables they clash
template_keys = st.sampled_from(["messages", "tokenize", "add_generation_prompt", "tools"]) | any_text
options = {
    "max_tokens": st.integers() | any_json,
    "max_completion_tokens": st.integers(),
    "n": st.integers() | any_json,
    "stream": st.booleans() | any_json,
    "tools": any_json,
    "chat_template_kwargs": st.dictionaries(template_keys, any_json, max_size=3) | any_json,
    "add_generation_prompt": st.booleans() | any_json,
    "model": any_text,
}
request_like = (
    st.fixed_dictionaries({"prompt": prompt}, optional=options)
    | st.fixed_dictionaries(
        {"messages": st.lists(message, min_size=1, max_size=3) | any_json}, optional=options
    )
    | st.fixed_dictionaries({}, optional={"prompt": prompt, "messages": any_json, **options})
)
nested = st.integers(min_value=1, max_value=5000).map(lambda depth: b"[" * depth + b"]" * depth)


@FUZZ
@given(path=st.sampled_from([COMPLETIONS, CHAT_COMPLETIONS]), body=request_like | any_json)
async def test_security_fuzzed_json_bodies_never_get_a_5xx_and_every_error_is_openai_shaped(
    router, http, path, body
) -> None:
    raw = json.dumps(body).encode()  # NaN, Infinity and \\ud800 escapes included: Python's json reads them
    status, answered = await answer(http, "POST", router.url + path, data=raw)
    if status >= 400:
        assert_openai_error(status, answered)


@pytest.mark.parametrize(
    "messages", [[["user", "hi"]], [{"role": "assistant", "tool_calls": ["x"]}], ["hi"]], ids=repr
)
async def test_security_malformed_messages_with_tools_are_routed_not_a_500(router, http, messages) -> None:
    """Found by the fuzz test above: rewriting tools into the prompt read a list as a message."""
    body = {"messages": messages, "tools": [{"type": "function", "function": {"name": "f"}}]}
    status, answered = await answer(http, "POST", router.url + CHAT_COMPLETIONS, json=body)
    assert status < 500, answered


@FUZZ
@given(path=st.sampled_from([COMPLETIONS, CHAT_COMPLETIONS]), raw=st.binary(max_size=300) | nested)
async def test_security_fuzzed_bytes_never_get_a_5xx_and_every_error_is_openai_shaped(
    router, http, path, raw
) -> None:
    status, answered = await answer(
        http, "POST", router.url + path, data=raw, headers={"Content-Type": "application/json"}
    )
    if status >= 400:
        assert_openai_error(status, answered)


@FUZZ
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
    path=st.sampled_from(
        [
            "/v1/completions",
            "/v1/chat/completions",
            "/v1/models",
            "/health",
            "/ready",
            "/metrics",
            "/",
            "/v1",
            "/v1/completions/x",
        ]
    )
    | st.from_regex(r"\A/[a-z0-9._/-]{0,24}\Z"),
)
async def test_security_fuzzed_methods_and_paths_never_get_a_5xx_and_every_error_is_openai_shaped(
    router, http, method, path
) -> None:
    status, answered = await answer(http, method, router.url + path, data=b"{}")
    if status >= 400:
        assert_openai_error(status, answered)


@pytest.mark.parametrize("request_bytes", MALFORMED)
async def test_security_a_request_aiohttp_cannot_parse_gets_an_openai_json_400(router, request_bytes) -> None:
    """aiohttp answers these before any middleware, in plain text; the router's connection class answers
    with the JSON error every other router error has (and closes the connection)."""
    status, headers, body = await exchange_async(router.url, request_bytes)  # read until it closes
    assert (status, headers["content-type"].split(";")[0]) == (400, "application/json")
    error = error_of(body)
    assert (error["code"], error["type"]) == ("invalid_http_request", "invalid_request_error")
    assert router.engine.received == []


NOT_GZIP = "request body is not valid gzip (its Content-Encoding)"


@pytest.mark.parametrize(
    ("encoding", "raw", "code", "message"),
    [
        ("gzip", b"not gzip at all", "invalid_encoding", NOT_GZIP),
        ("GZIP", b"not gzip at all", "invalid_encoding", NOT_GZIP),
        (
            "deflate",
            b"\x78\x9c not deflate",
            "invalid_encoding",
            "request body is not valid deflate (its Content-Encoding)",
        ),
        # a gzip stream cut short is refused, not parsed as the prefix of its JSON it decodes to
        (
            "gzip",
            gzip.compress(b'{"prompt": "hello"}', mtime=0)[:12],
            "invalid_encoding",
            NOT_GZIP + ": it ends before its stream does",
        ),
        (
            "deflate",
            zlib.compress(b'{"prompt": "hello"}') + b"tail",
            "invalid_encoding",
            "request body is not valid deflate (its Content-Encoding): data after the end of its stream",
        ),
    ],
)
async def test_security_a_body_that_does_not_decode_as_its_content_encoding_is_a_400(
    router, http, encoding: str, raw: bytes, code: str, message: str
) -> None:
    status, body = await answer(
        http, "POST", router.url + COMPLETIONS, data=raw, headers={"Content-Encoding": encoding}
    )
    error = assert_openai_error(status, body)
    assert (status, error["code"], error["message"][: len(message)]) == (400, code, message)
    assert router.engine.received == []


async def test_a_body_that_does_not_decode_closes_its_connection_and_the_next_request_is_served(
    router, http, caplog
) -> None:
    # the rest of such a body cannot be read, so the connection cannot carry another request: the refusal
    # says so, rather than aiohttp dropping it afterwards with an unhandled-exception traceback in the log
    headers = {"Content-Encoding": "gzip"}
    async with http.post(router.url + COMPLETIONS, data=b"not gzip at all", headers=headers) as response:
        refused = (
            response.status,
            response.headers.get("Connection"),
            (await response.json())["error"]["code"],
        )
    assert refused == (400, "close", "invalid_encoding")
    status, _ = await answer(http, "POST", router.url + COMPLETIONS, json={"prompt": "after"})
    assert status == 200
    assert "Unhandled exception" not in caplog.text


async def test_a_compressed_body_is_forwarded_decoded_with_headers_that_describe_it(router, http) -> None:
    plain = b'{"prompt": "hello", "max_tokens": 3}'
    status, body = await answer(
        http,
        "POST",
        router.url + COMPLETIONS,
        data=gzip.compress(plain, mtime=0),
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
    )
    assert (status, json.loads(body)["usage"]["prompt_tokens"]) == (200, 3)
    ((_, headers, received),) = router.engine.received
    assert received == {"prompt": "hello", "max_tokens": 3}
    assert "Content-Encoding" not in headers
    assert headers["Content-Length"] == str(len(plain))


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "deflate, gzip", "gzip, gzip", "x-gzip"])
async def test_a_content_encoding_the_router_cannot_undo_is_a_415_naming_those_it_can(
    router, http, encoding: str
) -> None:
    # as the engine answers it (the router decodes with the engine's decoder): before, aiohttp passed such a
    # body on undecoded, or refused br/zstd (no library here) as a 400 invalid_http_request
    headers = {"Content-Encoding": encoding, "Content-Type": "application/json"}
    async with http.post(router.url + COMPLETIONS, data=b'{"prompt": "hello"}', headers=headers) as response:
        refused = (
            response.status,
            response.headers.get("Connection"),
            response.headers.get("Accept-Encoding"),
            (await response.json())["error"],
        )
    assert refused[:3] == (415, "close", "gzip, deflate")
    assert refused[3]["code"] == "unsupported_encoding"
    assert refused[3]["message"].startswith(f"Content-Encoding {encoding!r} is not supported")
    assert router.engine.received == []


@pytest.mark.parametrize("encoding", ["identity", "Identity", ""])
async def test_an_identity_content_encoding_is_the_body_as_sent(router, http, encoding: str) -> None:
    headers = {"Content-Encoding": encoding, "Content-Type": "application/json"}
    status, _ = await answer(
        http, "POST", router.url + COMPLETIONS, data=b'{"prompt": "hello"}', headers=headers
    )
    assert status == 200
    assert [received for _, _, received in router.engine.received] == [{"prompt": "hello"}]


async def test_repeated_content_encoding_lines_are_one_list_of_codings(router) -> None:
    # as the engine reads them; before, the first line alone counted: a body gzipped once under two gzip
    # lines was decoded once and forwarded
    body = gzip.compress(b'{"prompt": "hello"}', mtime=0)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Encoding: gzip\r\nContent-Encoding: gzip\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    status, _, reply = await exchange_async(router.url, head.encode() + body)
    error = error_of(reply)
    assert (status, error["code"]) == (415, "unsupported_encoding")
    assert error["message"].startswith("Content-Encoding 'gzip, gzip' is not supported")
    assert router.engine.received == []
