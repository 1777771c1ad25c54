"""What a ``spec.model.source`` names, and where its files are inside the pod
(docs/architecture.md#model-delivery). Shared by the operator (pod template, validation) and the
fetcher (``fetch``), so the two always agree on URLs and paths; it imports nothing beyond the standard
library.

Forms:

- ``smollm2-135m`` / ``tiny-random``: bundled with the engine; an absolute path: in the image or on a
  volume; ``pvc://<claim>[/<path>]``: the claim mounted read-only at ``/models/<claim>``;
- fetched into the pod's model cache by an init container before the engine starts:
  ``https://…/<file>.gguf`` and ``http://…`` (in-cluster mirrors), ``s3://<bucket>/<key>.gguf`` from an
  S3-compatible endpoint, ``hf://<org>/<name>[@<revision>]`` (a Hugging Face repository with
  config.json, tokenizer.json and safetensors) or ``hf://<org>/<name>[@<revision>]/<path>.gguf`` (one
  file of it), from a Hugging Face endpoint or mirror.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass

PVC_SCHEME = "pvc://"
MODELS_MOUNT = "/models"  # PVC claims are mounted under it
FETCH_MOUNT = "/model-cache"  # the fetched files: an emptyDir the init container fills
DEFAULT_HF_ENDPOINT = "https://huggingface.co"
DEFAULT_S3_REGION = "us-east-1"
BUNDLED = ("smollm2-135m", "tiny-random")

_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_BUCKET = r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]"
HTTP_PATTERN = r"^https?://[^\s/?#]+/[^\s?#]*\.gguf(\?[^\s#]*)?$"
S3_PATTERN = rf"^s3://{_BUCKET}/[^\s?#]+\.gguf$"
HF_PATTERN = rf"^hf://{_NAME}/{_NAME}(@[A-Za-z0-9._/-]+?)?(/[^\s?#@]+\.gguf)?$"
_HF = re.compile(
    rf"^hf://(?P<repo>{_NAME}/{_NAME})(@(?P<rev>[A-Za-z0-9._/-]+?))?(/(?P<file>[^\s?#@]+\.gguf))?$",
    re.ASCII,  # \s as in RE2, which validated the source (spec_validation)
)
#: every form the CRD accepts, as one pattern (crd_schema.py)
SOURCE_PATTERN = (
    rf"^({'|'.join(BUNDLED)}|/\S+|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/\S*)?|"
    rf"{HTTP_PATTERN[1:-1]}|{S3_PATTERN[1:-1]}|{HF_PATTERN[1:-1]})$"
)
#: fetched sources that are one file (``sha256`` applies to these)
SINGLE_FILE_PATTERN = r"^(https?|s3)://.*$|^hf://.*\.gguf$"

# The credentials the init container gets from model.credentialsSecret: the Secret's keys are the
# variables' names for s3://, and TOKEN_KEY (as TOKEN_ENV, sent as a bearer token) for the others.
S3_CREDENTIAL_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
S3_SESSION_TOKEN_KEY = "AWS_SESSION_TOKEN"
TOKEN_KEY = "token"
TOKEN_ENV = "KVPILOT_FETCH_TOKEN"

#: the files of an hf:// repository the engine reads; the weights are listed by the index when sharded
HF_REQUIRED_FILES = ("config.json", "tokenizer.json")
HF_OPTIONAL_FILES = ("tokenizer_config.json", "generation_config.json", "special_tokens_map.json")
HF_WEIGHTS_INDEX = "model.safetensors.index.json"
HF_SINGLE_WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class Fetch:
    """A source the init container downloads."""

    scheme: str  # "http", "s3" or "hf"
    location: str  # the URL (http), bucket/key (s3), org/name (hf)
    revision: str = "main"  # hf only
    file: str | None = None  # hf: one file of the repository

    @property
    def single_file(self) -> bool:
        return self.scheme != "hf" or self.file is not None

    @property
    def local_name(self) -> str:
        """The file (or, for an hf repository, the directory) name under FETCH_MOUNT."""
        if self.scheme == "hf":
            if self.file is not None:
                return _safe(self.file.rsplit("/", 1)[-1])
            return _safe(f"{self.location.replace('/', '--')}--{self.revision}")
        path = urllib.parse.urlsplit(self.location).path if self.scheme == "http" else self.location
        return _safe(path.rsplit("/", 1)[-1])

    def url(self, endpoint: str | None, name: str | None = None) -> str:
        """Where to GET the source (``name``: a file of an hf repository)."""
        if self.scheme == "http":
            return self.location
        base = (endpoint or (DEFAULT_HF_ENDPOINT if self.scheme == "hf" else "")).rstrip("/")
        if self.scheme == "s3":
            return f"{base}/{urllib.parse.quote(self.location)}"  # path-style: <endpoint>/<bucket>/<key>
        file = name or self.file or ""
        return f"{base}/{self.location}/resolve/{urllib.parse.quote(self.revision, safe='')}/{file}"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "model"


def parse_fetch(source: str) -> Fetch | None:
    """The download a source needs, or None for a source the pod already has (name, path, PVC)."""
    if source.startswith(("https://", "http://")):
        return Fetch("http", source)
    if source.startswith("s3://"):
        return Fetch("s3", source[len("s3://") :])
    if source.startswith("hf://"):
        match = _HF.match(source)
        if match is None:
            raise ValueError(
                f"not an hf:// source: {source!r} (hf://<org>/<name>[@<revision>][/<file>.gguf])"
            )
        return Fetch("hf", match["repo"], match["rev"] or "main", match["file"])
    return None


def pvc_claim(source: str) -> str | None:
    if not source.startswith(PVC_SCHEME):
        return None
    return source[len(PVC_SCHEME) :].split("/", 1)[0]


def engine_path(source: str) -> str:
    """What the engine and router get as --model: the name or path, a PVC's or a fetched file's mount
    path."""
    fetch = parse_fetch(source)
    if fetch is not None:
        return f"{FETCH_MOUNT}/{fetch.local_name}"
    claim = pvc_claim(source)
    if claim is None:
        return source
    rest = source[len(PVC_SCHEME) + len(claim) :].strip("/")
    return f"{MODELS_MOUNT}/{claim}/{rest}" if rest else f"{MODELS_MOUNT}/{claim}"
