"""The model fetcher (the pods' init container) against a local HTTP server: checksums, the size limit,
Hugging Face mirrors, S3 request signing, and what it says when it fails. Nothing leaves this machine."""

from __future__ import annotations

import argparse
import hashlib
import http.server
import json
import threading
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest

from kvpilot.operator import fetch
from kvpilot.operator.model_source import engine_path, parse_fetch
from kvpilot.operator.s3_signing import Credentials, sign_get


class Server:
    """Serves ``files`` (URL path -> bytes); records each request's path and headers. ``no_length`` paths
    are streamed without a Content-Length, ``lying`` ones declare fewer bytes than they send."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.no_length: set[str] = set()
        self.requests: list[tuple[str, dict[str, str]]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # the stdlib calls the handler by this name
                outer.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                body = outer.files.get(self.path.split("?")[0])
                if body is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                if self.path in outer.no_length:
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for start in range(0, len(body), 65536):
                        chunk = body[start : start + 65536]
                        self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                    self.wfile.write(b"0\r\n\r\n")
                    return
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def paths(self) -> list[str]:
        return [path for path, _ in self.requests]


@pytest.fixture()
def server() -> Iterator[Server]:
    serving = Server()
    yield serving
    serving.httpd.shutdown()
    serving.httpd.server_close()


def run(
    source: str, dest: Path, *, size_limit: int = 1 << 20, env: dict[str, str] | None = None, **flags: str
):
    args = argparse.Namespace(
        source=source,
        dest=str(dest),
        size_limit=size_limit,
        sha256=flags.get("sha256"),
        endpoint=flags.get("endpoint"),
        region=flags.get("region", "us-east-1"),
    )
    return fetch.run(args, env or {})


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


MODEL = b"GGUF" + bytes(range(256)) * 64  # 16 KiB standing in for a model file


def test_a_file_is_fetched_verified_and_found_where_the_engine_looks(server, tmp_path, capsys):
    server.files["/m/model.gguf"] = MODEL
    source = f"{server.url}/m/model.gguf"
    assert run(source, tmp_path, sha256=sha(MODEL)) == 0
    path = Path(engine_path(source).replace("/model-cache", str(tmp_path)))
    assert path == tmp_path / "model.gguf" and path.read_bytes() == MODEL
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]  # no partial file left
    assert "fetched" in capsys.readouterr().out
    # a restarted init container finds it done: no second download
    assert run(source, tmp_path, sha256=sha(MODEL)) == 0
    assert server.paths() == ["/m/model.gguf"]


def test_a_checksum_mismatch_fails_naming_both_digests_and_keeps_nothing(server, tmp_path, capsys):
    server.files["/model.gguf"] = MODEL
    wrong = "0" * 64
    assert run(f"{server.url}/model.gguf", tmp_path, sha256=wrong) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (
        f"model fetch failed: sha256 mismatch for {server.url}/model.gguf: expected {wrong}, "
        f"got {sha(MODEL)} (model.sha256)"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_file_over_the_size_limit_is_refused(server, tmp_path, capsys, declared):
    server.files["/big.gguf"] = bytes(3 << 20)
    if not declared:
        server.no_length.add("/big.gguf")
    assert run(f"{server.url}/big.gguf", tmp_path, size_limit=1 << 20) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    if declared:  # refused from its headers, before the body
        assert last == (
            f"model fetch failed: {server.url}/big.gguf is 3.0 MiB, over the size limit (1.0 MiB, "
            "model.sizeLimit): refused before downloading"
        )
    else:  # counted while streaming
        assert last == (
            f"model fetch failed: {server.url}/big.gguf sent more than the size limit allows (1.0 MiB, "
            "model.sizeLimit): refused"
        )
    assert list(tmp_path.iterdir()) == []


def test_http_errors_are_named_and_query_strings_never_shown(server, tmp_path, capsys):
    assert run(f"{server.url}/missing.gguf?X-Amz-Signature=secret", tmp_path) == 1
    err = capsys.readouterr().err
    assert err.strip().endswith(f"model fetch failed: GET {server.url}/missing.gguf: HTTP 404 Not Found")
    assert "secret" not in err
    assert run("http://127.0.0.1:9/nothing-listens.gguf", tmp_path) == 1
    assert "model fetch failed: GET http://127.0.0.1:9/nothing-listens.gguf:" in capsys.readouterr().err


def test_a_bearer_token_is_sent_when_given(server, tmp_path):
    server.files["/model.gguf"] = MODEL
    assert run(f"{server.url}/model.gguf", tmp_path, env={"KVPILOT_FETCH_TOKEN": "t0k"}) == 0
    assert server.requests[0][1]["authorization"] == "Bearer t0k"


def hf_mirror(server: Server, repo: str, revision: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        server.files[f"/{repo}/resolve/{revision}/{name}"] = data


def test_an_hf_repository_is_fetched_from_the_mirror_with_its_shards(server, tmp_path):
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    files = {
        "config.json": b"{}",
        "tokenizer.json": b"{}",
        "tokenizer_config.json": b"{}",
        "model.safetensors.index.json": json.dumps(index).encode(),
        "model-00001-of-00002.safetensors": b"1" * 100,
        "model-00002-of-00002.safetensors": b"2" * 100,
    }
    hf_mirror(server, "org/tiny", "v1", files)
    source = "hf://org/tiny@v1"
    assert run(source, tmp_path, endpoint=server.url, env={"KVPILOT_FETCH_TOKEN": "hf"}) == 0
    model_dir = tmp_path / "org--tiny--v1"
    assert engine_path(source) == "/model-cache/org--tiny--v1"
    assert sorted(p.name for p in model_dir.iterdir()) == sorted(files)
    assert all(headers["authorization"] == "Bearer hf" for _, headers in server.requests)
    assert [p.name for p in tmp_path.iterdir()] == ["org--tiny--v1"]


def test_an_hf_repository_without_an_index_has_one_weights_file_and_shares_the_size_limit(
    server, tmp_path, capsys
):
    hf_mirror(server, "org/one", "main", {"config.json": b"{}", "tokenizer.json": b"{}"})
    server.files["/org/one/resolve/main/model.safetensors"] = b"w" * 2000
    assert run("hf://org/one", tmp_path, endpoint=server.url, size_limit=1000) == 1
    assert "over the size limit" in capsys.readouterr().err
    assert not (tmp_path / "org--one--main").exists()
    assert run("hf://org/one", tmp_path, endpoint=server.url, size_limit=4000) == 0
    assert (tmp_path / "org--one--main" / "model.safetensors").stat().st_size == 2000


def test_one_gguf_of_an_hf_repository(server, tmp_path):
    hf_mirror(server, "org/quant", "main", {"sub/q4.gguf": MODEL})
    source = "hf://org/quant/sub/q4.gguf"
    assert run(source, tmp_path, endpoint=server.url, sha256=sha(MODEL)) == 0
    assert (tmp_path / "q4.gguf").read_bytes() == MODEL and engine_path(source) == "/model-cache/q4.gguf"


def test_s3_requests_are_signed_path_style(server, tmp_path):
    server.files["/models/llama/q4.gguf"] = MODEL
    env = {"AWS_ACCESS_KEY_ID": "AKID", "AWS_SECRET_ACCESS_KEY": "secret", "AWS_SESSION_TOKEN": "session"}
    assert run("s3://models/llama/q4.gguf", tmp_path, endpoint=server.url, region="eu-west-1", env=env) == 0
    path, headers = server.requests[0]
    assert path == "/models/llama/q4.gguf"
    sent_at = datetime.strptime(headers["x-amz-date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
    expected = sign_get(f"{server.url}{path}", Credentials("AKID", "secret", "session"), "eu-west-1", sent_at)
    assert headers["authorization"] == expected["authorization"]
    assert headers["authorization"].startswith(
        f"AWS4-HMAC-SHA256 Credential=AKID/{headers['x-amz-date'][:8]}/eu-west-1/s3/"
    )
    assert headers["x-amz-security-token"] == "session"
    assert (tmp_path / "q4.gguf").read_bytes() == MODEL


def test_signature_v4_matches_awss_published_example():
    """The GET Object example of AWS's Signature Version 4 documentation, byte for byte."""
    headers = sign_get(
        "https://examplebucket.s3.amazonaws.com/test.txt",
        Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"),
        "us-east-1",
        datetime(2013, 5, 24, tzinfo=timezone.utc),
        {"Range": "bytes=0-9"},
    )
    assert headers["authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,"
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,"
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
    )


def test_s3_signs_the_host_header_the_client_sends(server, tmp_path):
    # An endpoint written in mixed case: the client sends the host lower-cased, and S3 checks the signature
    # over the Host header it received, so that is the one signed.
    server.files["/models/q4.gguf"] = MODEL
    port = server.url.rsplit(":", 1)[1]
    env = {"AWS_ACCESS_KEY_ID": "AKID", "AWS_SECRET_ACCESS_KEY": "secret"}
    endpoint = f"http://LocalHost:{port}"
    assert run("s3://models/q4.gguf", tmp_path, endpoint=endpoint, region="eu-west-1", env=env) == 0
    path, headers = server.requests[0]
    assert headers["host"] == f"localhost:{port}"
    sent_at = datetime.strptime(headers["x-amz-date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
    as_received = sign_get(
        f"http://{headers['host']}{path}", Credentials("AKID", "secret"), "eu-west-1", sent_at
    )
    assert headers["authorization"] == as_received["authorization"]


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("https://MinIO.Storage.svc/b/k.gguf", "minio.storage.svc"),
        ("https://minio.storage.svc:443/b/k.gguf", "minio.storage.svc"),
        ("http://minio.storage.svc:80/b/k.gguf", "minio.storage.svc"),
        ("http://minio.storage.svc:443/b/k.gguf", "minio.storage.svc:443"),
        ("https://minio.storage.svc:9000/b/k.gguf", "minio.storage.svc:9000"),
        ("http://[FD00::1]:9000/b/k.gguf", "[fd00::1]:9000"),
    ],
)
def test_s3_signs_the_normalised_host_and_sends_that_host(url, host):
    # As botocore signs (lower-case host, the scheme's default port dropped), and as httpx would send it.
    import httpx

    credentials, now = Credentials("AKID", "secret"), datetime(2013, 5, 24, tzinfo=timezone.utc)
    headers = sign_get(url, credentials, "us-east-1", now)
    assert headers["host"] == host == httpx.URL(url).netloc.decode("ascii").lower()
    normalised = url.split("/", 3)
    normalised[2] = host
    assert (
        headers["authorization"]
        == sign_get("/".join(normalised), credentials, "us-east-1", now)["authorization"]
    )


@pytest.mark.parametrize(
    ("source", "scheme", "location", "revision", "file"),
    [
        (
            "https://mirror.internal/a/b/m.gguf?sig=1",
            "http",
            "https://mirror.internal/a/b/m.gguf?sig=1",
            "main",
            None,
        ),
        ("s3://bucket/dir/m.gguf", "s3", "bucket/dir/m.gguf", "main", None),
        ("hf://org/name", "hf", "org/name", "main", None),
        ("hf://org/name@refs/pr/1", "hf", "org/name", "refs/pr/1", None),
        ("hf://org/name@abc123/dir/m.gguf", "hf", "org/name", "abc123", "dir/m.gguf"),
    ],
)
def test_sources_parse_into_what_to_fetch(source, scheme, location, revision, file):
    parsed = parse_fetch(source)
    assert parsed is not None
    assert (parsed.scheme, parsed.location, parsed.revision, parsed.file) == (
        scheme,
        location,
        revision,
        file,
    )


def test_sources_the_pod_already_has_need_no_fetch():
    assert [parse_fetch(s) for s in ("smollm2-135m", "/models/x.gguf", "pvc://claim/x")] == [None, None, None]
