"""The EndpointSlice watcher on the official ``kubernetes`` client against the e2e harness's emulated API
server: list, watch, label selection and the JSON the real client hands over."""

from __future__ import annotations

import queue
import sys
from pathlib import Path

import pytest

from kvpilot.router.endpointslices import Endpoint, EndpointSliceWatcher, KubernetesSliceApi

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e"))  # the harness package (read only)

from harness.cluster import HarnessCluster

pytestmark = pytest.mark.e2e


def endpoint_slice(name: str, service: str, address: str, ready: bool = True) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
        "endpoints": [{"addresses": [address], "conditions": {"ready": ready}, "zone": "zone-a"}],
    }


def test_watcher_follows_a_services_slices_through_the_kubernetes_client(tmp_path, monkeypatch):
    cluster = HarnessCluster(tmp_path).start()
    watcher = None
    try:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
        from kubernetes import client

        api = KubernetesSliceApi()  # falls back from in-cluster config to the kubeconfig
        discovery = client.DiscoveryV1Api()
        discovery.create_namespaced_endpoint_slice(
            "default", endpoint_slice("engines-a", "svc-engines", "10.1.0.1")
        )
        discovery.create_namespaced_endpoint_slice("default", endpoint_slice("other-a", "other", "10.9.0.1"))
        published: queue.Queue[list[Endpoint]] = queue.Queue()
        watcher = EndpointSliceWatcher(
            "svc-engines", "default", "http", published.put, lambda: api, watch_timeout_s=5
        )
        watcher.start()
        assert published.get(timeout=10) == [Endpoint("http://10.1.0.1:8000", "zone-a")]
        discovery.create_namespaced_endpoint_slice(
            "default", endpoint_slice("engines-b", "svc-engines", "10.1.0.2")
        )
        assert [e.url for e in published.get(timeout=10)] == ["http://10.1.0.1:8000", "http://10.1.0.2:8000"]
        discovery.replace_namespaced_endpoint_slice(
            "engines-a", "default", endpoint_slice("engines-a", "svc-engines", "10.1.0.1", ready=False)
        )
        assert [e.url for e in published.get(timeout=10)] == ["http://10.1.0.2:8000"]
        discovery.delete_namespaced_endpoint_slice("engines-b", "default")
        assert published.get(timeout=10) == []
        assert published.empty()  # the other Service's slice never showed up
    finally:
        if watcher is not None:
            watcher.stop()
        cluster.stop()
