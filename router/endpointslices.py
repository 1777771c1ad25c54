"""Replica discovery from a Kubernetes Service's EndpointSlices, via the official ``kubernetes`` client.

List, then watch from the list's resourceVersion; on a watch error re-list (410 Gone, "resourceVersion too
old", at once; anything else after a backoff), so the fleet is rebuilt from a consistent list rather than
patched across a hole. Runs in a thread (the client is synchronous) and publishes each changed endpoint set
through a callback, which the router hops onto its event loop.

Which addresses count: an endpoint whose ``ready`` condition is not false (nil means ready, per the API)
and that is not terminating; its first address (the API makes addresses of one endpoint fungible), with
its zone and, from its ``targetRef``, its pod's name (how error messages name a replica). The engines'
headless Service publishes not-ready addresses (a pod's readiness includes its router's, which needs an
engine), so the router's own ``/load`` polls decide which engines take traffic.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
HTTP_GONE = 410


@dataclass(frozen=True, order=True)
class Endpoint:
    url: str
    zone: str | None = None
    pod: str | None = None


class SliceApi(Protocol):
    def list(self, namespace: str, selector: str) -> tuple[list[dict[str, Any]], str]: ...
    def watch(
        self, namespace: str, selector: str, resource_version: str, timeout_s: int
    ) -> Iterator[dict[str, Any]]: ...
    def stop(self) -> None: ...


class WatchGone(Exception):
    """The watch's resourceVersion is too old (HTTP 410): re-list."""


def endpoints_from_slices(slices: Iterable[dict[str, Any]], port_name: str) -> list[Endpoint]:
    """The engine endpoints that EndpointSlices (JSON form, camelCase) list, deduplicated and sorted."""
    found: dict[str, Endpoint] = {}
    for endpoint_slice in slices:
        port = _slice_port(endpoint_slice.get("ports") or [], port_name)
        if port is None or endpoint_slice.get("addressType") not in ("IPv4", "IPv6", "FQDN"):
            continue
        for endpoint in endpoint_slice.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            addresses = endpoint.get("addresses") or []
            if conditions.get("ready") is False or conditions.get("terminating") is True or not addresses:
                continue
            host = addresses[0]
            url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
            ref = endpoint.get("targetRef") or {}
            pod = ref.get("name") if ref.get("kind") == "Pod" else None
            found.setdefault(url, Endpoint(url, endpoint.get("zone"), pod))
    return sorted(found.values())


def _slice_port(ports: list[dict[str, Any]], port_name: str) -> int | None:
    for port in ports:
        if port.get("name") == port_name and isinstance(port.get("port"), int):
            return port["port"]
    if len(ports) == 1 and isinstance(ports[0].get("port"), int):
        return ports[0]["port"]
    return None


class KubernetesSliceApi:
    """:class:`SliceApi` on the official client: in a pod its service account, elsewhere the kubeconfig."""

    def __init__(self) -> None:
        from kubernetes import client, config  # imported here: a static-list router never pays for it

        try:
            config.load_incluster_config()
        except config.ConfigException:
            # the client snapshots $KUBECONFIG when it is first imported; read it now instead
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
        self._api = client.DiscoveryV1Api()
        self._watch: Any = None

    def list(self, namespace: str, selector: str) -> tuple[list[dict[str, Any]], str]:
        # _preload_content=False: the raw urllib3 response (its JSON), not the client's generated model
        response: Any = self._api.list_namespaced_endpoint_slice(
            namespace, label_selector=selector, _preload_content=False
        )
        body = json.loads(response.data)
        return body.get("items") or [], body["metadata"]["resourceVersion"]

    def watch(
        self, namespace: str, selector: str, resource_version: str, timeout_s: int
    ) -> Iterator[dict[str, Any]]:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        self._watch = watch.Watch()
        try:
            # With timeout_seconds the client does not retry a 410 itself: it raises, and we re-list.
            for event in self._watch.stream(
                self._api.list_namespaced_endpoint_slice,
                namespace,
                label_selector=selector,
                resource_version=resource_version,
                timeout_seconds=timeout_s,
                allow_watch_bookmarks=True,
            ):
                yield {"type": event["type"], "object": event["raw_object"]}
        except ApiException as error:
            if error.status == HTTP_GONE:
                raise WatchGone(str(error.reason)) from None
            raise

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.stop()


class EndpointSliceWatcher:
    def __init__(
        self,
        service: str,
        namespace: str,
        port_name: str,
        publish: Callable[[list[Endpoint]], None],
        api_factory: Callable[[], SliceApi],
        watch_timeout_s: int = 300,
        backoff_s: tuple[float, float] = (0.5, 10.0),
    ) -> None:
        self.service = service
        self.namespace = namespace
        self._selector = f"{SERVICE_NAME_LABEL}={service}"
        self._port_name = port_name
        self._publish = publish
        self._api_factory = api_factory
        self._api: SliceApi | None = None
        self._watch_timeout_s = watch_timeout_s
        self._backoff_s = backoff_s
        self._stopped = threading.Event()
        self._published: list[Endpoint] | None = None
        self._thread = threading.Thread(target=self._run, name=f"endpointslices-{service}", daemon=True)
        #: how many times the watcher listed (the first list and every re-list)
        self.lists = 0

    def start(self) -> None:
        self._api = self._api_factory()  # config errors surface here, in the caller
        self._thread.start()

    def stop(self, timeout_s: float = 1.0) -> None:
        self._stopped.set()
        if self._api is not None:
            self._api.stop()
        if self._thread.is_alive():
            self._thread.join(timeout_s)  # a blocked read ends at the watch timeout; the thread is a daemon

    def _run(self) -> None:
        delay = self._backoff_s[0]
        while not self._stopped.is_set():
            try:
                self._list_and_watch()
                delay = self._backoff_s[0]
            except WatchGone as gone:
                log.info("EndpointSlice watch of %s expired (%s); re-listing", self.service, gone)
            except Exception as error:  # any failure: back off, re-list, keep serving
                log.warning(
                    "EndpointSlice watch of %s/%s failed: %s; re-listing in %.1fs",
                    self.namespace,
                    self.service,
                    error,
                    delay,
                )
                if self._stopped.wait(delay):
                    return
                delay = min(delay * 2, self._backoff_s[1])

    def _list_and_watch(self) -> None:
        assert self._api is not None
        items, resource_version = self._api.list(self.namespace, self._selector)
        self.lists += 1
        slices = {item["metadata"]["name"]: item for item in items}
        self._publish_if_changed(slices)
        while not self._stopped.is_set():
            for event in self._api.watch(
                self.namespace, self._selector, resource_version, self._watch_timeout_s
            ):
                kind, obj = event["type"], event["object"]
                resource_version = obj.get("metadata", {}).get("resourceVersion", resource_version)
                if kind in ("ADDED", "MODIFIED"):
                    slices[obj["metadata"]["name"]] = obj
                elif kind == "DELETED":
                    slices.pop(obj["metadata"]["name"], None)
                else:
                    continue  # BOOKMARK: only its resourceVersion matters
                self._publish_if_changed(slices)
                if self._stopped.is_set():
                    return

    def _publish_if_changed(self, slices: dict[str, dict[str, Any]]) -> None:
        endpoints = endpoints_from_slices(slices.values(), self._port_name)
        if endpoints != self._published:
            self._published = endpoints
            self._publish(endpoints)
