"""How the model reaches a replica's pod: its volumes, the storage it requests, and for a fetched source
the init container that downloads it (docs/architecture.md#model-delivery).

- ``tmp``: the scratch emptyDir (conversions, caches), sized by ``model_size.scratch_quantity``;
- ``model``: the PVC of a ``pvc://`` source, read-only (a claim shared by replicas on several nodes needs
  the ReadOnlyMany access mode: ReadWriteOnce binds it to one node, where every replica then has to run);
- ``model-cache``: for a fetched source, an emptyDir of ``model.sizeLimit`` that the init container
  ``fetch-model`` (``kvpilot operator fetch-model``, the engine's image) fills and the engine and router
  mount read-only. The pod's containers start only once it succeeded; its failure message (the fetcher's
  last line, ``FallbackToLogsOnError``) is what ``replicas`` reports.
"""

from __future__ import annotations

from typing import Any

from kubernetes.utils import parse_quantity

from kvpilot.operator import model_source as ms
from kvpilot.operator.api_names import FETCH_CONTAINER
from kvpilot.operator.model_size import scratch_quantity
from kvpilot.operator.spec import ModelSpec

FETCH_VOLUME = "model-cache"
FETCH_CPU = "100m"
FETCH_MEMORY = "256Mi"  # streams in 1 MiB chunks: the interpreter and httpx, not the model


def _mebibytes(quantity: int) -> str:
    return f"{-(-quantity // 2**20)}Mi"


def storage_request(model: ModelSpec) -> str:
    """The engine container's ephemeral-storage request: the scratch volume, plus the fetched model."""
    total = int(parse_quantity(scratch_quantity(model.source, model.cache_size)))
    if model.fetch is not None:
        total += int(parse_quantity(model.size_limit))
    return _mebibytes(total)


def model_volumes(model: ModelSpec) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {"sizeLimit": scratch_quantity(model.source, model.cache_size)}}
    ]
    if model.pvc_claim:
        volumes.append(
            {"name": "model", "persistentVolumeClaim": {"claimName": model.pvc_claim, "readOnly": True}}
        )
    if model.fetch is not None:
        volumes.append({"name": FETCH_VOLUME, "emptyDir": {"sizeLimit": model.size_limit}})
    return volumes


def fetch_args(model: ModelSpec) -> list[str]:
    args = [
        "--source",
        model.source,
        "--dest",
        ms.FETCH_MOUNT,
        "--size-limit",
        str(int(parse_quantity(model.size_limit))),
    ]
    if model.sha256:
        args += ["--sha256", model.sha256]
    if model.endpoint:
        args += ["--endpoint", model.endpoint]
    if model.fetch is not None and model.fetch.scheme == "s3":
        args += ["--region", model.region]
    return args


def _secret_env(name: str, secret: str, key: str, optional: bool = False) -> dict[str, Any]:
    ref: dict[str, Any] = {"name": secret, "key": key}
    if optional:
        ref["optional"] = True
    return {"name": name, "valueFrom": {"secretKeyRef": ref}}


def _credentials_env(model: ModelSpec) -> list[dict[str, Any]]:
    """Only the init container gets the credentials: the engine and router never need them."""
    secret, fetch = model.credentials_secret, model.fetch
    if secret is None or fetch is None:
        return []
    if fetch.scheme == "s3":
        env = [_secret_env(key, secret, key) for key in ms.S3_CREDENTIAL_KEYS]
        return [*env, _secret_env(ms.S3_SESSION_TOKEN_KEY, secret, ms.S3_SESSION_TOKEN_KEY, optional=True)]
    return [_secret_env(ms.TOKEN_ENV, secret, ms.TOKEN_KEY)]


def fetch_init_container(model: ModelSpec, image: str, security_context: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": FETCH_CONTAINER,
        "image": image,
        "command": ["kvpilot", "operator", "fetch-model"],
        "args": fetch_args(model),
        "volumeMounts": [{"name": FETCH_VOLUME, "mountPath": ms.FETCH_MOUNT}],
        "resources": {
            "requests": {"cpu": FETCH_CPU, "memory": FETCH_MEMORY},
            "limits": {"memory": FETCH_MEMORY},
        },
        # The fetcher's last stderr line (a checksum mismatch, a refused size) becomes the termination
        # message the operator reports.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": security_context,
    }
    env = _credentials_env(model)
    if env:
        container["env"] = env
    return container
