"""A small, dict-in dict-out Kubernetes API client for the handful of calls the operator makes.

It rides on the official client's ApiClient (configuration, auth, TLS, in-cluster or kubeconfig) but skips
its typed models: the builders produce plain dicts, and round-tripping them through models would drop
fields the models do not know and fail on objects the models consider incomplete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client, config

# kind -> plural for the kinds the operator reads and writes.
PLURALS = {
    "ServiceAccount": "serviceaccounts",
    "Secret": "secrets",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "Service": "services",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "Deployment": "deployments",
    "Pod": "pods",
    "InferenceService": "inferenceservices",
    "Lease": "leases",
    "Event": "events",
    "EndpointSlice": "endpointslices",
}
MERGE_PATCH = "application/merge-patch+json"


@dataclass(frozen=True)
class ObjectRef:
    api_version: str
    kind: str
    namespace: str
    name: str | None = None

    @classmethod
    def of(cls, obj: dict[str, Any]) -> ObjectRef:
        return cls(obj["apiVersion"], obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])

    @property
    def path(self) -> str:
        prefix = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        path = f"{prefix}/namespaces/{self.namespace}/{PLURALS[self.kind]}"
        return f"{path}/{self.name}" if self.name else path

    def __str__(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}"


class KubeApiError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status = status


def load_client_configuration() -> None:
    """In a pod use its service account; elsewhere the kubeconfig (KUBECONFIG or ~/.kube/config)."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


class KubeApi:
    def __init__(self, api_client: client.ApiClient | None = None, request_timeout: float = 10.0) -> None:
        self._client = api_client or client.ApiClient()
        self._timeout = request_timeout

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        method, url, headers, body, _ = self._client.param_serialize(
            method,
            path,
            query_params=query or [],
            body=body,
            auth_settings=["BearerToken"],
            header_params={"Accept": "application/json", "Content-Type": content_type},
        )
        try:
            response = self._client.call_api(
                method, url, header_params=headers, body=body, _request_timeout=self._timeout
            )
            data = response.read() or b"{}"
        except client.ApiException as error:  # transport-level failures (TLS, connection)
            raise KubeApiError(int(error.status or 0), str(error.reason), str(error.body)) from None
        except (urllib3.exceptions.HTTPError, OSError) as error:  # timeouts, refused connections
            raise KubeApiError(0, "Unreachable", f"{method} {path}: {error}") from None
        if not 200 <= response.status < 300:
            raise _api_error(response.status, response.reason, data)
        return json.loads(data)

    def get(self, ref: ObjectRef) -> dict[str, Any] | None:
        try:
            return self._call("GET", ref.path)
        except KubeApiError as error:
            if error.status == 404:
                return None
            raise

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        ref = ObjectRef.of(obj)
        collection = ObjectRef(ref.api_version, ref.kind, ref.namespace)
        return self._call("POST", collection.path, body=obj)

    def replace(self, obj: dict[str, Any]) -> dict[str, Any]:
        """PUT the whole object; its metadata.resourceVersion makes the write conditional (409 if stale)."""
        return self._call("PUT", ObjectRef.of(obj).path, body=obj)

    def merge_patch(self, ref: ObjectRef, patch: dict[str, Any], subresource: str = "") -> dict[str, Any]:
        path = f"{ref.path}/{subresource}" if subresource else ref.path
        return self._call("PATCH", path, body=patch, content_type=MERGE_PATCH)

    def list(self, ref: ObjectRef, label_selector: str) -> list[dict[str, Any]]:
        return self._call("GET", ref.path, query=[("labelSelector", label_selector)]).get("items", [])


def _api_error(status_code: int, reason: str, data: bytes) -> KubeApiError:
    try:
        status = json.loads(data)
    except ValueError:
        status = {}
    if not isinstance(status, dict):
        status = {}
    return KubeApiError(
        status_code,
        status.get("reason") or str(reason),
        status.get("message") or data.decode(errors="replace"),
    )
