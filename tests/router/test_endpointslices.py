"""EndpointSlice discovery: which addresses count, and the list/watch/re-list cycle (410 Gone, errors)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

from kvpilot.router.endpointslices import Endpoint, EndpointSliceWatcher, WatchGone, endpoints_from_slices


def endpoint(
    address: str, ready: bool | None = True, terminating: bool | None = None, zone: str | None = "zone-a"
) -> dict[str, Any]:
    conditions = {k: v for k, v in (("ready", ready), ("terminating", terminating)) if v is not None}
    return {"addresses": [address, "ignored-second-address"], "conditions": conditions, "zone": zone}


def slice_(
    name: str,
    endpoints: list[dict],
    ports: list[dict] | None = None,
    family: str = "IPv4",
    version: str = "1",
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "resourceVersion": version},
        "addressType": family,
        "ports": [{"name": "http", "port": 8000}] if ports is None else ports,
        "endpoints": endpoints,
    }


def test_ready_non_terminating_first_addresses_with_zone_and_named_port():
    slices = [
        slice_(
            "s1",
            [
                endpoint("10.0.0.1"),
                endpoint("10.0.0.2", ready=False),
                endpoint("10.0.0.3", ready=None),
                endpoint("10.0.0.4", terminating=True),
                endpoint("10.0.0.5", zone=None),
            ],
            ports=[{"name": "metrics", "port": 9090}, {"name": "http", "port": 8000}],
        ),
        slice_("s2", [endpoint("fd00::7", zone="zone-b"), endpoint("10.0.0.1")], family="IPv6"),
        slice_("s3", [endpoint("10.0.0.9")], ports=[{"name": "other", "port": 7000}]),  # one port: that one
        slice_(
            "s4", [endpoint("10.0.0.10")], ports=[{"name": "a", "port": 1}, {"name": "b", "port": 2}]
        ),  # none
        {"metadata": {"name": "s5"}, "addressType": "IPv4", "ports": None, "endpoints": None},
    ]
    assert endpoints_from_slices(slices, "http") == [
        Endpoint("http://10.0.0.1:8000", "zone-a"),
        Endpoint("http://10.0.0.3:8000", "zone-a"),
        Endpoint("http://10.0.0.5:8000", None),
        Endpoint("http://10.0.0.9:7000", "zone-a"),
        Endpoint("http://[fd00::7]:8000", "zone-b"),
    ]


def test_an_endpoints_pod_name_comes_from_its_target_ref():
    slices = [
        slice_(
            "s1",
            [
                {**endpoint("10.0.0.1"), "targetRef": {"kind": "Pod", "name": "engine-0", "namespace": "ns"}},
                {**endpoint("10.0.0.2"), "targetRef": {"kind": "Node", "name": "node-1"}},
            ],
        )
    ]
    assert endpoints_from_slices(slices, "http") == [
        Endpoint("http://10.0.0.1:8000", "zone-a", "engine-0"),
        Endpoint("http://10.0.0.2:8000", "zone-a", None),
    ]


class FakeSliceApi:
    """Lists return the current slices; each watch call consumes scripted events until a sentinel."""

    END = object()

    def __init__(self, slices: list[dict]) -> None:
        self.slices = slices
        self.events: queue.Queue[Any] = queue.Queue()
        self.list_calls = 0
        self.watch_versions: list[str] = []

    def list(self, namespace: str, selector: str) -> tuple[list[dict], str]:
        assert (namespace, selector) == ("ns", "kubernetes.io/service-name=svc-engines")
        self.list_calls += 1
        return list(self.slices), str(self.list_calls * 100)

    def watch(self, namespace: str, selector: str, resource_version: str, timeout_s: int) -> Iterator[dict]:
        self.watch_versions.append(resource_version)
        while True:
            item = self.events.get(timeout=5)
            if item is self.END:
                return
            if isinstance(item, Exception):
                raise item
            yield item

    def stop(self) -> None:
        self.events.put(self.END)


def test_watch_applies_changes_and_relists_after_gone_and_errors():
    api = FakeSliceApi([slice_("s1", [endpoint("10.0.0.1")])])
    published: queue.Queue[list[Endpoint]] = queue.Queue()
    watcher = EndpointSliceWatcher(
        "svc-engines", "ns", "http", published.put, lambda: api, backoff_s=(0.01, 0.02)
    )
    watcher.start()
    try:
        assert published.get(timeout=5) == [Endpoint("http://10.0.0.1:8000", "zone-a")]
        api.events.put({"type": "ADDED", "object": slice_("s2", [endpoint("10.0.0.2")], version="101")})
        assert [e.url for e in published.get(timeout=5)] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
        api.events.put({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "150"}}})
        api.events.put(
            {"type": "MODIFIED", "object": slice_("s1", [endpoint("10.0.0.1", ready=False)], version="160")}
        )
        assert [e.url for e in published.get(timeout=5)] == ["http://10.0.0.2:8000"]
        api.events.put(FakeSliceApi.END)  # the server ended the watch (timeout): resume from the last version
        api.events.put({"type": "DELETED", "object": slice_("s2", [], version="170")})
        assert published.get(timeout=5) == []
        assert api.watch_versions == ["100", "160"]
        # 410 Gone: re-list at once and publish the listed truth (a slice that appeared meanwhile).
        api.slices = [slice_("s3", [endpoint("10.0.0.3")])]
        api.events.put(WatchGone("too old resource version"))
        assert [e.url for e in published.get(timeout=5)] == ["http://10.0.0.3:8000"]
        assert watcher.lists == 2 and api.watch_versions[-1] == "200"
        # Any other failure: back off, then re-list.
        api.events.put(RuntimeError("connection reset"))
        api.slices = [slice_("s3", [endpoint("10.0.0.3")]), slice_("s4", [endpoint("10.0.0.4")])]
        assert [e.url for e in published.get(timeout=5)] == ["http://10.0.0.3:8000", "http://10.0.0.4:8000"]
        assert watcher.lists == 3
    finally:
        watcher.stop()
    assert not any(t.name == "endpointslices-svc-engines" and t.is_alive() for t in threading.enumerate())


async def test_a_router_follows_its_services_slices(fake_engines, tiny_profiler, http, until):
    from kvpilot.router.app import RouterApp
    from kvpilot.router.config import DiscoveryConfig, PollConfig, RouterConfig
    from kvpilot.router.proxy import REPLICA_HEADER
    from kvpilot.router.server import RouterServer

    first, second = await fake_engines(2)
    api = FakeSliceApi(
        [
            slice_(f"s{i}", [endpoint("127.0.0.1")], ports=[{"name": "http", "port": e.port}])
            for i, e in enumerate((first, second))
        ]
    )
    config = RouterConfig(
        DiscoveryConfig(endpointslice_service="svc-engines", namespace="ns"), poll=PollConfig(interval_s=0.02)
    )
    server = await RouterServer(RouterApp(config, tiny_profiler, lambda: api)).start()
    try:
        fleet = server.router.fleet
        await until(lambda: len(fleet.routable()) == 2)
        assert {r.zone for r in fleet.replicas.values()} == {"zone-a"}
        api.events.put({"type": "DELETED", "object": slice_("s0", [], version="101")})
        await until(lambda: list(fleet.replicas) == [second.url])
        async with http.post(
            server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}
        ) as response:
            assert response.headers[REPLICA_HEADER] == second.url
    finally:
        await server.stop()
