"""The chart's pre-delete hook: settle every InferenceService before `helm uninstall` removes the operator.

The operator's finalizer (kopf's, ``kvpilot.dev/finalizer``) can only be removed by a running operator. If
the operator goes first, every InferenceService deleted later (by hand, or with the CRD) hangs in
Terminating. So, while the operator still runs, this hook (``uninstall.inferenceServices`` in values.yaml):

- ``delete``: deletes every InferenceService the operator serves and waits until the operator has
  finalized them (their Deployments, Services, Secrets... go by owner-reference garbage collection). Past
  ``--timeout`` (an operator that is down or stuck) it removes the finalizer itself, which is safe: the
  operator's delete handler only drops metrics series, and the children go by garbage collection anyway.
- ``orphan``: scales the operator to zero, waits until its pods are gone, then removes the finalizer from
  every InferenceService. The models keep serving, unmanaged; deleting one later is immediate, and a
  reinstalled operator adopts them again.

It refuses to act unless Helm's record of this release says it is being uninstalled
(``--release-record``), so the hook applied by mistake (``helm template | kubectl apply``) deletes nothing.

Runs in the operator's image (its ``kubernetes`` client); in a pod it uses the service account, elsewhere
the kubeconfig. Exit status: 0 when done, 1 when it could not finish (helm uninstall then fails and says so;
the message names what is left), 2 when it refused.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kubernetes import client, config

PLURAL_PATH = "/apis/{group}/{version}"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
POLL_SECONDS = 2.0
PROGRESS_SECONDS = 15.0


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Api:
    """The few REST calls the hook makes, dict in and dict out."""

    def __init__(self) -> None:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        self._client = client.ApiClient()

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        query: list[tuple[str, str]] | None = None,
    ) -> Any:
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
                method, url, header_params=headers, body=body, _request_timeout=30
            )
        except client.ApiException as error:
            raise ApiError(int(error.status or 0), str(error.reason)) from None
        data = response.read() or b"{}"
        if not 200 <= response.status < 300:
            try:
                message = json.loads(data).get("message", "")
            except (ValueError, AttributeError):
                message = data.decode(errors="replace")
            raise ApiError(response.status, message or str(response.reason))
        return json.loads(data)

    def get(self, path: str) -> dict[str, Any] | None:
        try:
            return self.call("GET", path)
        except ApiError as error:
            if error.status == 404:
                return None
            raise


def log(message: str) -> None:
    print(f"[kvpilot uninstall] {message}", flush=True)


def _name(obj: dict[str, Any]) -> str:
    return f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"


class Hook:
    def __init__(self, api: Api, args: argparse.Namespace) -> None:
        self.api = api
        self.args = args
        self.base = PLURAL_PATH.format(group=args.group, version=args.version)

    def collection_paths(self) -> list[str]:
        if not self.args.namespace:
            return [f"{self.base}/{self.args.plural}"]
        return [f"{self.base}/namespaces/{ns}/{self.args.plural}" for ns in self.args.namespace]

    def object_path(self, obj: dict[str, Any]) -> str:
        metadata = obj["metadata"]
        return f"{self.base}/namespaces/{metadata['namespace']}/{self.args.plural}/{metadata['name']}"

    def inference_services(self) -> list[dict[str, Any]] | None:
        """Every InferenceService in scope; None when the API has no such resource (CRD deleted)."""
        items: list[dict[str, Any]] = []
        for path in self.collection_paths():
            found = self.api.get(path)
            if found is None:
                return None
            items.extend(found.get("items", []))
        return items

    # --- the guard -----------------------------------------------------------------------------------------

    def release_is_uninstalling(self) -> bool:
        """Helm marks its release record (a Secret, or a ConfigMap with HELM_DRIVER=configmap) with the label
        status=uninstalling before it runs the pre-delete hooks."""
        ns, record = self.args.release_namespace, self.args.release_record
        for kind in ("secrets", "configmaps"):
            obj = self.api.get(f"/api/v1/namespaces/{ns}/{kind}/{record}")
            if obj is not None:
                status = obj["metadata"].get("labels", {}).get("status")
                if status == "uninstalling":
                    return True
                log(f"Helm release record {ns}/{record} has status {status!r}, not 'uninstalling'")
                return False
        log(f"no Helm release record {ns}/{record} (Secret or ConfigMap)")
        return False

    # --- finalizers ----------------------------------------------------------------------------------------

    def drop_finalizer(self, obj: dict[str, Any]) -> bool:
        """Remove our finalizer (a JSON patch that tests it is still where we saw it); False if gone."""
        for _ in range(5):
            finalizers = obj["metadata"].get("finalizers", [])
            if self.args.finalizer not in finalizers:
                return False
            index = finalizers.index(self.args.finalizer)
            patch = [
                {"op": "test", "path": f"/metadata/finalizers/{index}", "value": self.args.finalizer},
                {"op": "remove", "path": f"/metadata/finalizers/{index}"},
            ]
            try:
                self.api.call("PATCH", self.object_path(obj), patch, JSON_PATCH)
                return True
            except ApiError as error:
                if error.status == 404:
                    return False
                if error.status not in (409, 422):  # 422: the test failed, someone changed the list
                    raise
            fresh = self.api.get(self.object_path(obj))
            if fresh is None:
                return False
            obj = fresh
        raise ApiError(409, f"{_name(obj)}: finalizers kept changing")

    # --- waiting -------------------------------------------------------------------------------------------

    def wait_gone(self, deadline: float) -> list[dict[str, Any]]:
        """Poll until no InferenceService is left or the deadline passes; return what is left."""
        last_report = 0.0
        while True:
            left = self.inference_services() or []
            if not left or time.monotonic() >= deadline:
                return left
            if time.monotonic() - last_report >= PROGRESS_SECONDS:
                log(f"waiting for the operator to finalize {len(left)}: {', '.join(map(_name, left[:10]))}")
                last_report = time.monotonic()
            time.sleep(POLL_SECONDS)

    # --- the two modes -------------------------------------------------------------------------------------

    def delete(self) -> int:
        services = self.inference_services()
        if services is None:
            log("no InferenceService API (the CRD is gone): nothing to do")
            return 0
        log(f"deleting {len(services)} InferenceServices while the operator still runs")
        for obj in services:
            try:
                self.api.call("DELETE", self.object_path(obj), {"propagationPolicy": "Background"})
                log(f"deleted {_name(obj)}")
            except ApiError as error:
                if error.status != 404:
                    raise
        left = self.wait_gone(time.monotonic() + self.args.timeout)
        if not left:
            log("every InferenceService is gone")
            return 0
        log(
            f"the operator did not finalize {len(left)} within {self.args.timeout:g} s (is it running? see "
            f"`kubectl -n {self.args.release_namespace} logs deploy/<release>`): removing its finalizer"
        )
        for obj in left:
            if self.drop_finalizer(obj):
                log(f"removed {self.args.finalizer} from {_name(obj)}")
        left = self.wait_gone(time.monotonic() + 30)
        stuck = [o for o in left if self.args.finalizer in o["metadata"].get("finalizers", [])]
        for obj in left:
            log(f"still there: {_name(obj)} (finalizers {obj['metadata'].get('finalizers', [])})")
        return 1 if stuck else 0

    def stop_operator(self) -> bool:
        ns, name = self.args.release_namespace, self.args.operator_deployment
        path = f"/apis/apps/v1/namespaces/{ns}/deployments/{name}"
        if self.api.get(path) is None:
            log(f"no operator Deployment {ns}/{name}")
        else:
            self.api.call("PATCH", path, {"spec": {"replicas": 0}}, STRATEGIC_MERGE_PATCH)
            log(f"scaled the operator Deployment {ns}/{name} to 0")
        pods_path, selector = (
            f"/api/v1/namespaces/{ns}/pods",
            [("labelSelector", self.args.operator_selector)],
        )
        deadline = time.monotonic() + self.args.timeout
        while True:
            found = self.api.call("GET", pods_path, query=selector).get("items", [])
            pods = [p["metadata"]["name"] for p in found]
            if not pods:
                log("no operator pod is running")
                return True
            if time.monotonic() >= deadline:
                log(f"operator pods still running after {self.args.timeout:g} s: {', '.join(pods)}")
                return False
            time.sleep(POLL_SECONDS)

    def orphan(self) -> int:
        if not self.stop_operator():
            return 1
        services = self.inference_services()
        if services is None:
            log("no InferenceService API (the CRD is gone): nothing to do")
            return 0
        for obj in services:
            if self.drop_finalizer(obj):
                log(f"orphaned {_name(obj)}: finalizer removed, its pods keep serving")
        log(f"{len(services)} InferenceServices left unmanaged; reinstalling the chart adopts them again")
        return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("delete", "orphan"), required=True)
    parser.add_argument("--namespace", action="append", default=[], help="repeat; none: all namespaces")
    parser.add_argument("--group", default="kvpilot.dev")
    parser.add_argument("--version", default="v1alpha1")
    parser.add_argument("--plural", default="inferenceservices")
    parser.add_argument("--finalizer", required=True)
    parser.add_argument("--release-namespace", required=True)
    parser.add_argument(
        "--release-record", help="name of Helm's release Secret/ConfigMap (sh.helm.release.v1...)"
    )
    parser.add_argument(
        "--no-release-check", action="store_true", help="act without checking --release-record"
    )
    parser.add_argument(
        "--operator-deployment", help="orphan: the operator's Deployment in --release-namespace"
    )
    parser.add_argument("--operator-selector", help="orphan: label selector of the operator's pods")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for the operator")
    args = parser.parse_args(argv)
    if not args.no_release_check and not args.release_record:
        parser.error("--release-record is required unless --no-release-check")
    if args.mode == "orphan" and not (args.operator_deployment and args.operator_selector):
        parser.error("--mode orphan needs --operator-deployment and --operator-selector")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hook = Hook(Api(), args)
    try:
        if not args.no_release_check and not hook.release_is_uninstalling():
            log("refusing: this hook only runs during `helm uninstall` (nothing was changed)")
            return 2
        return hook.delete() if args.mode == "delete" else hook.orphan()
    except ApiError as error:
        log(f"failed: {error}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
