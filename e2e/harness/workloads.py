"""The controllers a real cluster runs for workloads, reduced to what the e2e tests observe.

- a Deployment controller that creates pods from the template (labelled with ``pod-template-hash``),
  rolls them honouring ``maxSurge``/``maxUnavailable``, and writes the Deployment's status;
- a kubelet loop that gives each new pod a loopback IP, has a ``PodRunner`` start it (with env from
  ``secretKeyRef`` resolved; a pod whose Secret is not there yet waits), writes the pod status the runner
  reports, and has the runner stop deleted pods;
- an EndpointSlice controller for Services with selectors (what the router sidecar watches).

``PodRunner`` is the seam: ``FakePodRunner`` (``pod_runners``) lets a test set each pod's stage;
``ProcessPodRunner`` (``process_runner``) runs the containers as local processes and reports what their
probes say.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
from typing import Any, Protocol

import kmock
from harness.apiserver import ApiServerHarness
from harness.container_launch import MissingSecret, resolve_secret_env
from harness.patches import matches_label_selector

log = logging.getLogger(__name__)

DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")
PODS = kmock.resource("", "v1", "pods")
SERVICES = kmock.resource("", "v1", "services")
SLICES = kmock.resource("discovery.k8s.io", "v1", "endpointslices")
SECRETS = kmock.resource("", "v1", "secrets")
LAST_POD_ADDRESS = 254  # pods get <ip_prefix>.2 … .254


class PodRunner(Protocol):
    async def start(self, pod: dict[str, Any]) -> None: ...  # the pod got its IP: start its containers

    async def stop(self, pod: dict[str, Any]) -> None: ...  # the pod is gone: stop them

    # the pod's status now, given the last one written (which carries the podIP)
    def status(self, pod: dict[str, Any], previous: dict[str, Any]) -> dict[str, Any]: ...

    async def close(self) -> None: ...  # the harness stops: stop every pod still running


def template_hash(template: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def _count(value: Any, desired: int, round_up: bool) -> int:
    if isinstance(value, str) and value.endswith("%"):
        share = desired * int(value[:-1]) / 100
        return int(-(-share // 1)) if round_up else int(share)
    return int(value or 0)


def is_ready(pod: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in pod.get("status", {}).get("conditions", [])
    )


class WorkloadControllers:
    def __init__(self, api: ApiServerHarness, runner: PodRunner, ip_prefix: str) -> None:
        self.api, self.runner, self.ip_prefix = api, runner, ip_prefix
        self._next_ip = 2
        self._started: set[str] = set()
        self._waiting: set[str] = set()  # pods held back for a Secret, each logged once
        self._events_seen = 0  # index into the store's event log: pod deletions handled so far
        self._task: asyncio.Task[None] | None = None

    def start(self, interval: float = 0.1) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(interval))

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        await self.runner.close()

    async def _loop(self, interval: float) -> None:
        while True:
            try:
                await self.step()
            except kmock.KubernetesError as error:
                # An object went away (or changed) under a step - a Deployment deleted while its pods were
                # being made. Like a real controller, requeue: the next step sees the new state. Letting
                # the error end this task would stop every pod and probe for the rest of the test.
                log.info("workload step retried: %s", error)
            await asyncio.sleep(interval)

    async def step(self) -> None:
        for key, _ in self.api.store.all_live():
            # re-read each: an earlier roll's awaits may have let a deletion (or its GC) run
            deployment = self.api.store.get(key) if key[0] == DEPLOYMENTS else None
            if deployment is not None:
                await self._roll(key, json.loads(json.dumps(deployment)))
        await self._kubelet()
        await self._endpoint_slices()

    def _pods_of(self, deployment: dict[str, Any]) -> list[tuple[Any, dict[str, Any]]]:
        uid = deployment["metadata"]["uid"]
        return [
            (key, pod)
            for key, pod in self.api.store.all_live()
            if key[0] == PODS
            and any(ref.get("uid") == uid for ref in pod["metadata"].get("ownerReferences", []))
        ]

    async def _roll(self, key: Any, deployment: dict[str, Any]) -> None:
        spec = deployment["spec"]
        desired = spec.get("replicas", 1)
        rolling = spec.get("strategy", {}).get("rollingUpdate", {})
        surge = _count(rolling.get("maxSurge", "25%"), desired, True)
        unavailable = _count(rolling.get("maxUnavailable", "25%"), desired, False)
        current = template_hash(spec["template"])
        pods = self._pods_of(deployment)
        new = [p for p in pods if p[1]["metadata"]["labels"].get("pod-template-hash") == current]
        old = [p for p in pods if p not in new]
        for _ in range(max(0, min(desired - len(new), desired + surge - len(pods)))):
            new.append(await self._create_pod(deployment, current))
        available = sum(is_ready(pod) for _, pod in new + old)
        # Old pods go first, not-ready ones before ready ones, never dropping below desired - maxUnavailable.
        surplus = sorted(old, key=lambda p: is_ready(p[1])) + sorted(
            new[desired:], key=lambda p: is_ready(p[1])
        )
        for pod_key, pod in surplus:
            if is_ready(pod) and available - 1 < desired - unavailable:
                continue
            available -= is_ready(pod)
            await self.api.delete(pod_key)
        pods = self._pods_of(deployment)
        updated = [p for _, p in pods if p["metadata"]["labels"].get("pod-template-hash") == current]
        ready = sum(is_ready(p) for _, p in pods)
        status = {
            "observedGeneration": deployment["metadata"]["generation"],
            "replicas": len(pods),
            "updatedReplicas": len(updated),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "conditions": [
                {"type": "Available", "status": "True" if ready >= desired - unavailable else "False"},
                {"type": "Progressing", "status": "True", "reason": "ReplicaSetUpdated"},
            ],
        }
        if deployment.get("status") != status:
            await self.api.update(key, {**deployment, "status": status}, subresource="status")

    async def _create_pod(self, deployment: dict[str, Any], current: str) -> tuple[Any, dict[str, Any]]:
        template = json.loads(json.dumps(deployment["spec"]["template"]))
        suffix = "".join(random.choices("bcdfghjkmnpqrstvwxz2456789", k=5))
        name = f"{deployment['metadata']['name']}-{current[:8]}-{suffix}"
        metadata = {
            **template.get("metadata", {}),
            "name": name,
            "labels": {**template.get("metadata", {}).get("labels", {}), "pod-template-hash": current},
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "controller": True,
                    "name": deployment["metadata"]["name"],
                    "uid": deployment["metadata"]["uid"],
                    "blockOwnerDeletion": True,
                }
            ],
        }
        namespace = deployment["metadata"]["namespace"]
        spec = {**template["spec"], "nodeName": "harness-node"}
        await self.api.create(PODS, namespace, {"metadata": metadata, "spec": spec})
        return (PODS, namespace, name), self.api.store.get((PODS, namespace, name)) or {}

    async def _kubelet(self) -> None:
        for key, pod in self.api.store.all_live():
            if key[0] != PODS:
                continue
            pod = json.loads(json.dumps(pod))
            status = pod.setdefault("status", {})
            if pod["metadata"]["uid"] not in self._started:
                try:
                    # what the containers get: env from Secrets resolved, as the kubelet does at start
                    launched = resolve_secret_env(pod, self._secret)
                except MissingSecret as error:
                    if pod["metadata"]["uid"] not in self._waiting:
                        self._waiting.add(pod["metadata"]["uid"])
                        log.info("pod %s/%s waits: %s", key[1], key[2], error)
                    continue
                self._waiting.discard(pod["metadata"]["uid"])
                if self._next_ip > LAST_POD_ADDRESS:
                    raise RuntimeError(f"the harness ran out of pod addresses in {self.ip_prefix}.0/24")
                self._started.add(pod["metadata"]["uid"])
                status["podIP"] = f"{self.ip_prefix}.{self._next_ip}"
                self._next_ip += 1
                await self.runner.start({**launched, "status": status})
            new_status = self.runner.status(pod, status)
            if new_status != status:
                await self.api.update(key, {**pod, "status": new_status}, subresource="status")
        events, self._events_seen = self.api.store.events[self._events_seen :], len(self.api.store.events)
        for event in [e for e in events if e.resource == PODS and e.type == "DELETED"]:
            uid = event.object["metadata"]["uid"]
            if uid in self._started:
                self._started.discard(uid)
                await self.runner.stop(event.object)

    def _secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.api.store.get((SECRETS, namespace, name))

    async def _endpoint_slices(self) -> None:
        for key, service in self.api.store.all_live():
            selector = service.get("spec", {}).get("selector")
            if key[0] != SERVICES or not selector:
                continue
            wanted = ",".join(f"{label}={value}" for label, value in selector.items())
            pods = [
                p
                for k, p in self.api.store.all_live()
                if k[0] == PODS
                and k[1] == key[1]
                and matches_label_selector(p["metadata"].get("labels", {}), wanted)
                and p.get("status", {}).get("podIP")
            ]
            publish_all = service["spec"].get("publishNotReadyAddresses", False)
            endpoints = [
                {
                    "addresses": [p["status"]["podIP"]],
                    "targetRef": {"kind": "Pod", "name": p["metadata"]["name"]},
                    "conditions": {"ready": publish_all or is_ready(p), "serving": is_ready(p)},
                }
                for p in pods
            ]
            ports = [
                {"name": port.get("name", ""), "port": _container_port(pods, port), "protocol": "TCP"}
                for port in service["spec"].get("ports", [])
            ]
            body = {
                "metadata": {
                    "name": f"{key[2]}-harness",
                    "labels": {"kubernetes.io/service-name": key[2]},
                    "ownerReferences": [
                        {
                            "apiVersion": "v1",
                            "kind": "Service",
                            "name": key[2],
                            "uid": service["metadata"]["uid"],
                            "controller": True,
                        }
                    ],
                },
                "addressType": "IPv4",
                "endpoints": endpoints,
                "ports": ports,
            }
            slice_key = (SLICES, key[1], f"{key[2]}-harness")
            existing = self.api.store.get(slice_key)
            if existing is None:
                await self.api.create(SLICES, key[1], body)
            elif {k: existing.get(k) for k in ("endpoints", "ports")} != {
                "endpoints": endpoints,
                "ports": ports,
            }:
                await self.api.update(slice_key, {**existing, "endpoints": endpoints, "ports": ports})


def _container_port(pods: list[dict[str, Any]], port: dict[str, Any]) -> int:
    target = port.get("targetPort", port["port"])
    if isinstance(target, int):
        return target
    for pod in pods:
        for container in pod["spec"]["containers"]:
            for declared in container.get("ports", []):
                if declared.get("name") == target:
                    return int(declared["containerPort"])
    return int(port["port"])
