"""``kvpilot operator fetch-model``: the init container that puts a fetched model source into the pod's
model cache before the engine starts (docs/architecture.md#model-delivery).

- Each file streams (httpx) into a hidden ``.part`` name beside its final one and is renamed only once it
  is complete and verified: the engine never sees a partial file, and an init container restarted on a
  volume that already holds the result has nothing to do.
- ``--size-limit``: a file whose Content-Length exceeds what is left of the limit is refused before its
  body is read; the bytes are counted while streaming too (a server that sends no length, or a wrong
  one); the partial file is removed. An hf:// repository's files share one limit.
- ``--sha256``: computed while streaming and compared before the rename.
- Failure: exit code 1 and one line ``model fetch failed: …`` last on stderr, which the pod's
  ``terminationMessagePolicy: FallbackToLogsOnError`` makes the container's termination message and the
  operator puts into the InferenceService's condition (reason ``ModelFetchFailed``). URLs in messages
  drop their query strings (a presigned URL's signature is a credential).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import urllib.parse
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from kvpilot.operator import model_source as ms
from kvpilot.operator.cli_checks import endpoint_url, fetched_source, positive_int, sha256_hex
from kvpilot.operator.s3_signing import Credentials, sign_get

if TYPE_CHECKING:
    import httpx

CHUNK_BYTES = 1 << 20
MESSAGE_PREFIX = "model fetch failed: "


class FetchError(Exception):
    """A fetch that must not be retried as is: the message says what to change."""


@dataclass(frozen=True)
class Options:
    source: str
    dest: Path
    size_limit: int
    sha256: str | None = None
    endpoint: str | None = None
    region: str = ms.DEFAULT_S3_REGION
    token: str | None = None
    s3: Credentials | None = None


def shown(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


class Fetcher:
    def __init__(self, options: Options, client: httpx.Client) -> None:
        self.options, self.client = options, client
        self.remaining = options.size_limit  # bytes still allowed

    def _headers(self, fetch: ms.Fetch, url: str) -> dict[str, str]:
        if fetch.scheme == "s3":
            if self.options.s3 is None:
                return {}  # a public bucket
            return sign_get(url, self.options.s3, self.options.region, datetime.now(timezone.utc))
        return {"authorization": f"Bearer {self.options.token}"} if self.options.token else {}

    def download(self, fetch: ms.Fetch, url: str, target: Path, sha256: str | None = None) -> bool:
        """GET ``url`` into ``target`` (verified, renamed into place); False if it answered 404."""
        import httpx

        part = target.with_name(f".{target.name}.part")
        digest, written = hashlib.sha256(), 0
        try:
            with self.client.stream("GET", url, headers=self._headers(fetch, url)) as response:
                if response.status_code == 404:
                    return False
                if response.status_code != 200:
                    raise FetchError(
                        f"GET {shown(url)}: HTTP {response.status_code} {response.reason_phrase}"
                    )
                declared = response.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > self.remaining:
                    raise FetchError(
                        f"{shown(url)} is {_mib(int(declared))}, over the size limit "
                        f"({_mib(self.options.size_limit)}, model.sizeLimit): refused before downloading"
                    )
                with part.open("wb") as out:
                    for chunk in response.iter_bytes(CHUNK_BYTES):
                        written += len(chunk)
                        if written > self.remaining:
                            raise FetchError(
                                f"{shown(url)} sent more than the size limit allows "
                                f"({_mib(self.options.size_limit)}, model.sizeLimit): refused"
                            )
                        digest.update(chunk)
                        out.write(chunk)
        except httpx.HTTPError as error:
            part.unlink(missing_ok=True)
            raise OSError(f"GET {shown(url)}: {error}") from None  # transient: the kubelet retries
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        if sha256 is not None and digest.hexdigest() != sha256:
            part.unlink()
            raise FetchError(
                f"sha256 mismatch for {shown(url)}: expected {sha256}, got {digest.hexdigest()} "
                "(model.sha256)"
            )
        self.remaining -= written
        part.rename(target)
        return True

    def _required(self, fetch: ms.Fetch, url: str, target: Path, sha256: str | None = None) -> None:
        if not self.download(fetch, url, target, sha256):
            raise FetchError(f"GET {shown(url)}: HTTP 404 Not Found")

    def _hf_repository(self, fetch: ms.Fetch, target: Path) -> None:
        building = target.with_name(f".{target.name}.part")
        shutil.rmtree(building, ignore_errors=True)
        building.mkdir(parents=True)
        endpoint = self.options.endpoint
        for name in ms.HF_REQUIRED_FILES:
            self._required(fetch, fetch.url(endpoint, name), building / name)
        for name in ms.HF_OPTIONAL_FILES:
            self.download(fetch, fetch.url(endpoint, name), building / name)
        index = building / ms.HF_WEIGHTS_INDEX
        if self.download(fetch, fetch.url(endpoint, ms.HF_WEIGHTS_INDEX), index):
            shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
            if not shards or any(
                "/" in s or s.startswith(".") or not s.endswith(".safetensors") for s in shards
            ):
                raise FetchError(
                    f"{ms.HF_WEIGHTS_INDEX} of {fetch.location}: no usable shard names ({shards[:3]})"
                )
            for shard in shards:
                self._required(fetch, fetch.url(endpoint, shard), building / shard)
        else:
            self._required(fetch, fetch.url(endpoint, ms.HF_SINGLE_WEIGHTS), building / ms.HF_SINGLE_WEIGHTS)
        building.rename(target)

    def run(self) -> Path:
        fetch = ms.parse_fetch(self.options.source)
        if fetch is None:
            raise FetchError(
                f"{self.options.source!r} is not a fetched source (https://, http://, s3://, hf://)"
            )
        target = self.options.dest / fetch.local_name
        if target.exists():
            return target  # renamed into place only when complete and verified: a restart finds it done
        self.options.dest.mkdir(parents=True, exist_ok=True)
        if fetch.single_file:
            self._required(fetch, fetch.url(self.options.endpoint), target, self.options.sha256)
        else:
            self._hf_repository(fetch, target)
        return target


def options_from(args: argparse.Namespace, env: dict[str, str]) -> Options:
    s3 = None
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        s3 = Credentials(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], env.get("AWS_SESSION_TOKEN"))
    return Options(
        source=args.source,
        dest=Path(args.dest),
        size_limit=args.size_limit,
        sha256=args.sha256,
        endpoint=args.endpoint,
        region=args.region,
        token=env.get(ms.TOKEN_ENV) or None,
        s3=s3,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--source", required=True, type=fetched_source, help="https://, http://, s3:// or hf:// model source"
    )
    parser.add_argument("--dest", required=True, help="the model cache directory")
    parser.add_argument("--size-limit", type=positive_int, required=True, metavar="BYTES")
    parser.add_argument("--sha256", type=sha256_hex, help="expected SHA-256 (hex) of a single-file source")
    parser.add_argument(
        "--endpoint", type=endpoint_url, help="S3-compatible endpoint, or Hugging Face endpoint/mirror"
    )
    parser.add_argument("--region", default=ms.DEFAULT_S3_REGION, help="S3 signing region")


def run(args: argparse.Namespace, env: dict[str, str] | None = None) -> int:
    """Credentials come from the environment (the init container's env from model.credentialsSecret)."""
    import httpx

    options = options_from(args, dict(os.environ) if env is None else env)
    timeout = httpx.Timeout(30.0, read=120.0)
    try:
        with httpx.Client(
            follow_redirects=True, timeout=timeout
        ) as client:  # cross-origin redirects lose auth
            target = Fetcher(options, client).run()
    except (FetchError, OSError) as error:
        print(f"{MESSAGE_PREFIX}{error}", file=sys.stderr)
        return 1
    print(f"fetched {shown(options.source)} into {target}")
    return 0
