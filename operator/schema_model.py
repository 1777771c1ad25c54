"""The ``spec.model`` block of the schema: where the weights come from and how a fetched source is checked."""

from __future__ import annotations

from typing import Any

from kvpilot.operator.model_source import DEFAULT_HF_ENDPOINT, DEFAULT_S3_REGION, SOURCE_PATTERN
from kvpilot.operator.schema_types import DNS_SUBDOMAIN_PATTERN, integer, obj, quantity

# Model sources: a bundled name, an absolute path inside the image or on a mounted volume,
# pvc://<claim>[/<path in the claim>] (mounted read-only), or a URL the init container fetches
# (operator/model_source.py says each form).
MODEL_SOURCE_PATTERN = SOURCE_PATTERN
DTYPES = ("auto", "float32", "float16", "bfloat16")
#: the engine's quantization values (engine/config.py's QUANTIZATIONS; a test keeps them equal)
QUANTIZATIONS = ("auto", "none", "gguf", "int8", "fp8")


def model_schema() -> dict[str, Any]:
    return obj(
        "Which model to serve and under which name.",
        {
            "source": {
                "type": "string",
                "pattern": MODEL_SOURCE_PATTERN,
                "maxLength": 512,
                "description": "smollm2-135m or tiny-random (bundled); an absolute path in the image or on "
                "a volume; pvc://<claim>/<path> (mounted read-only at /models/<claim>; a claim shared by "
                "replicas on several nodes needs the ReadOnlyMany access mode); or fetched into the pod's "
                "model cache by an init container before the engine starts: https://.../<file>.gguf (or "
                "http:// for an in-cluster mirror), s3://<bucket>/<key>.gguf (from model.endpoint), "
                "hf://<org>/<name>[@<revision>] (a Hugging Face repository with config.json, "
                "tokenizer.json and safetensors) or hf://<org>/<name>[@<revision>]/<path>.gguf, from "
                f"model.endpoint ({DEFAULT_HF_ENDPOINT} when unset).",
            },
            "sha256": {
                "type": "string",
                "pattern": "^[0-9a-f]{64}$",
                "description": "Lower-case hex SHA-256 of a fetched single-file source: the download is "
                "checked before the engine starts, and a mismatch fails the replica (condition reason "
                "ModelFetchFailed) naming both digests. Pin an hf:// repository by its revision instead.",
            },
            "sizeLimit": quantity(
                "The most a fetched source may download (all its files together; default 10Gi): a larger "
                "one is refused before or while it streams, failing the replica (ModelFetchFailed). Also "
                "the size of the volume the files are fetched into."
            ),
            "cacheSize": quantity(
                "Size of each replica's scratch volume (an emptyDir: weights converted from GGUF, "
                "tokenizer and kernel caches), set as its sizeLimit and as the engine's ephemeral-storage "
                "request (with sizeLimit for fetched sources). Default: what a bundled model's conversion "
                "needs, else 10Gi; a GGUF converted to float32 takes about 8 times its 4-bit size."
            ),
            "endpoint": {
                "type": "string",
                "pattern": r"^https?://[^\s/]+(/\S*)?$",
                "maxLength": 512,
                "description": "Where s3:// and hf:// sources are fetched from: the S3-compatible endpoint "
                f"(required for s3://, path-style requests) or the Hugging Face endpoint or mirror "
                f"(HF_ENDPOINT-style; {DEFAULT_HF_ENDPOINT} when unset).",
            },
            "region": {
                "type": "string",
                "pattern": "^[a-z0-9-]+$",
                "maxLength": 64,
                "description": f"Region s3:// requests are signed for (AWS Signature V4; {DEFAULT_S3_REGION} "
                "when unset).",
            },
            "credentialsSecret": {
                "type": "string",
                "pattern": DNS_SUBDOMAIN_PATTERN,
                "maxLength": 253,
                "description": "A Secret in the InferenceService's namespace with the fetch credentials, "
                "read only by the init container: keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and "
                "AWS_SESSION_TOKEN) for s3:// (requests are then signed), key token for https://, http:// "
                "and hf:// (sent as Authorization: Bearer). Without it, requests are anonymous.",
            },
            "servedName": {
                "type": "string",
                "minLength": 1,
                "maxLength": 128,
                "pattern": r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$",
                "description": "Model name clients send in OpenAI requests; defaults to the "
                "InferenceService name.",
            },
            "dtype": {
                "type": "string",
                "enum": list(DTYPES),
                "default": "auto",
                "description": "Weight and activation dtype.",
            },
            "quantization": {
                "type": "string",
                "enum": list(QUANTIZATIONS),
                "default": "auto",
                "description": "Weights kept quantized (the engine's --quantization): auto keeps a GGUF's "
                "blocks where a kernel runs them and an fp8 checkpoint's e4m3 weights on GPUs; none; gguf; "
                "int8 (per output row, quantized at load); fp8 (e4m3 on GPUs) "
                "(docs/architecture.md#quantized-weights).",
            },
            "startupTimeoutSeconds": integer(
                "How long the engine may take to load and start serving /health before Kubernetes restarts "
                "it; defaults to an estimate from the model's size.",
                30,
                86400,
            ),
        },
        ("spec", "model"),
        required=("source",),
        default_empty=False,
    )
