"""Request bodies with a Content-Encoding (engine/server/body_encoding.py): gzip and deflate are decoded (a
gzip body got "There was an error parsing the body", and br or an unknown coding was read as if sent
plain), other codings are 415, a body that does not decode is 400 and one that decodes past
``--max-body-bytes`` (a bomb) 413, both closing the connection."""

from __future__ import annotations

import gzip
import json
import zlib

import httpx
import pytest
from raw_http import error_of, exchange

from kvpilot.engine.server.body_encoding import MAX_GZIP_MEMBERS, BodyDecoder
from kvpilot.engine.server.errors import APIError

pytestmark = pytest.mark.e2e
BODY = json.dumps(
    {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
).encode()
LIMIT = 65536  # the session server's --max-body-bytes


def _raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


def _post(server, body: bytes, encoding: str) -> httpx.Response:
    headers = {**server.headers, "content-type": "application/json", "content-encoding": encoding}
    return httpx.post(server.url + "/v1/completions", content=body, headers=headers, timeout=60)


def _exchange(server, body: bytes, encoding: str) -> tuple[int, dict[str, str], dict]:
    """A raw request with another one pipelined behind it: read until the server closes, which it must."""
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.api_key}\r\n"
        f"Content-Type: application/json\r\nContent-Encoding: {encoding}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    status, headers, reply = exchange(server.url, head.encode() + body + b"GET /health HTTP/1.1\r\n\r\n")
    return status, headers, error_of(reply)


@pytest.mark.parametrize(
    ("encoding", "coded"),
    [
        ("gzip", gzip.compress(BODY)),
        ("GZip", gzip.compress(BODY[:10]) + gzip.compress(BODY[10:])),  # concatenated members
        ("deflate", zlib.compress(BODY)),  # RFC 1950: zlib-wrapped
        ("deflate", _raw_deflate(BODY)),  # what many clients send as deflate
        ("identity", BODY),
    ],
    ids=["gzip", "gzip-members", "deflate-zlib", "deflate-raw", "identity"],
)
def test_a_coded_body_is_served_as_the_plain_one(tiny_server, encoding, coded):
    plain = _post(tiny_server, BODY, "identity")
    r = _post(tiny_server, coded, encoding)
    assert r.status_code == 200, r.text
    assert r.json()["choices"] == plain.json()["choices"]


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "gzip, br"])
def test_a_coding_the_server_cannot_decode_is_415(tiny_server, encoding):
    status, headers, error = _exchange(tiny_server, BODY, encoding)
    assert (status, headers["accept-encoding"], headers["connection"]) == (415, "gzip, deflate", "close")
    assert error == {
        "message": f"Content-Encoding {encoding!r} is not supported: send the body as gzip, deflate or "
        "identity (one coding)",
        "type": "invalid_request_error",
        "param": None,
        "code": "unsupported_encoding",
    }


@pytest.mark.parametrize(("lines", "status"), [(["gzip", "gzip"], 415), (["gzip", "identity"], 200)])
def test_repeated_content_encoding_lines_are_one_list_of_codings(tiny_server, lines, status):
    # before, the last line alone counted: a body gzipped once under two gzip lines was decoded and served
    body = gzip.compress(BODY)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {tiny_server.api_key}\r\n"
        "Content-Type: application/json\r\nConnection: close\r\n"
        + "".join(f"Content-Encoding: {line}\r\n" for line in lines)
        + f"Content-Length: {len(body)}\r\n\r\n"
    )
    got, _, reply = exchange(tiny_server.url, head.encode() + body)
    assert got == status
    if status == 415:
        assert error_of(reply)["message"].startswith("Content-Encoding 'gzip, gzip' is not supported")


@pytest.mark.parametrize(
    ("encoding", "coded", "why"),
    [
        ("gzip", BODY, ""),  # not gzip at all
        ("gzip", b"\x1f\x8b\x08\x00" + b"garbage" * 4, ""),
        ("gzip", gzip.compress(BODY)[:-6], ": it ends before its stream does"),
        ("deflate", zlib.compress(BODY) + b"tail", ": data after the end of its stream"),
        (
            "gzip",
            gzip.compress(b"") * MAX_GZIP_MEMBERS + gzip.compress(BODY),
            ": more than 1024 gzip members",
        ),
    ],
    ids=["not-gzip", "corrupt", "truncated", "trailing-data", "too-many-members"],
)
def test_a_body_that_does_not_decode_is_400_and_closes(tiny_server, encoding, coded, why):
    status, headers, error = _exchange(tiny_server, coded, encoding)
    assert (status, headers["connection"]) == (400, "close")
    assert error == {
        "message": f"request body is not valid {encoding} (its Content-Encoding){why}",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_encoding",
    }


def test_security_a_bomb_is_413_and_closes(tiny_server):
    bomb = gzip.compress(b" " * (32 << 20), 9)  # 32 MiB of JSON whitespace, in a body of ~32 KiB
    assert len(bomb) < LIMIT
    status, headers, error = _exchange(tiny_server, bomb, "gzip")
    assert (status, headers["connection"]) == (413, "close")
    assert error == {
        "message": f"the request body exceeds {LIMIT} bytes once decoded from its Content-Encoding",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_too_large",
    }
    assert _post(tiny_server, gzip.compress(BODY), "gzip").status_code == 200


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_bomb_is_inflated_one_byte_past_the_limit_and_no_further(encoding):
    plain = b"0" * (64 << 20)
    coded = gzip.compress(plain) if encoding == "gzip" else zlib.compress(plain)
    decoder = BodyDecoder(encoding, 1024)
    with pytest.raises(APIError) as exc:
        decoder.feed(coded)
    assert (exc.value.status, exc.value.code, decoder.decoded_bytes) == (413, "request_too_large", 1025)
