"""Container probes as the kubelet runs them: the probe spec with its defaults, one check, and the verdict.

A probe's *verdict* is not its last check: it flips only after ``failureThreshold`` failures or
``successThreshold`` successes in a row, and it starts from a per-kind initial value (readiness: failure,
liveness: success, startup: unknown). A failed liveness or startup verdict puts the probe on hold until
the container is replaced (the kubelet restarts it). This mirrors the kubelet's prober worker
(``pkg/kubelet/prober/worker.go``); the scheduling around it (ticks, initial delay, which probe runs when)
lives in ``container_supervisor``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp

STARTUP, READINESS, LIVENESS = "startup", "readiness", "liveness"
PROBE_FIELDS = {STARTUP: "startupProbe", READINESS: "readinessProbe", LIVENESS: "livenessProbe"}
# The verdict before the first conclusive check (None: unknown).
INITIAL_VERDICT: dict[str, bool | None] = {STARTUP: None, READINESS: False, LIVENESS: True}
USER_AGENT = "kube-probe/harness"


class UnsupportedPod(Exception):
    """The pod asks for something the process kubelet does not emulate; the message says what."""


@dataclass(frozen=True)
class HttpGet:
    port: int
    path: str = "/"
    host: str | None = None  # None: the pod IP, as on a cluster
    scheme: str = "HTTP"
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class TcpSocket:
    port: int
    host: str | None = None


@dataclass(frozen=True)
class ProbeSpec:
    kind: str
    action: HttpGet | TcpSocket
    initial_delay_s: float = 0
    period_s: float = 10
    timeout_s: float = 1
    success_threshold: int = 1
    failure_threshold: int = 3
    # a probe may override the pod's terminationGracePeriodSeconds for the kill it causes
    termination_grace_s: float | None = None


def _port(value: Any, container: dict[str, Any], where: str) -> int:
    if isinstance(value, int):
        return value
    for declared in container.get("ports", []):
        if declared.get("name") == value:
            return int(declared["containerPort"])
    if isinstance(value, str) and value.isdigit():
        return int(value)
    raise UnsupportedPod(f"{where}.port: {value!r} names no port of container {container.get('name')!r}")


def parse_probe(kind: str, container: dict[str, Any]) -> ProbeSpec | None:
    """The container's probe of ``kind`` with the API's defaults filled in; None when it has none."""
    probe = container.get(PROBE_FIELDS[kind])
    if probe is None:
        return None
    where = f"container {container.get('name')!r} {PROBE_FIELDS[kind]}"
    if "httpGet" in probe:
        get = probe["httpGet"]
        scheme = get.get("scheme", "HTTP")
        if scheme not in ("HTTP", "HTTPS"):
            raise UnsupportedPod(f"{where}.httpGet.scheme: {scheme!r} is neither HTTP nor HTTPS")
        action: HttpGet | TcpSocket = HttpGet(
            port=_port(get.get("port"), container, f"{where}.httpGet"),
            path=get.get("path", "/"),
            host=get.get("host"),
            scheme=scheme,
            headers=tuple((h["name"], h["value"]) for h in get.get("httpHeaders", [])),
        )
    elif "tcpSocket" in probe:
        socket = probe["tcpSocket"]
        action = TcpSocket(
            port=_port(socket.get("port"), container, f"{where}.tcpSocket"), host=socket.get("host")
        )
    else:
        handlers = sorted(set(probe) & {"exec", "grpc"}) or ["none"]
        raise UnsupportedPod(f"{where}: only httpGet and tcpSocket probes are emulated (got {handlers[0]})")
    return ProbeSpec(
        kind=kind,
        action=action,
        initial_delay_s=probe.get("initialDelaySeconds", 0),
        period_s=probe.get("periodSeconds", 10),
        timeout_s=probe.get("timeoutSeconds", 1),
        success_threshold=probe.get("successThreshold", 1),
        failure_threshold=probe.get("failureThreshold", 3),
        termination_grace_s=probe.get("terminationGracePeriodSeconds"),
    )


async def check(
    action: HttpGet | TcpSocket, pod_ip: str, timeout_s: float, session: aiohttp.ClientSession
) -> bool:
    """One check. HTTP: any status in [200, 400) passes; TCP: the connection opens. Timeouts fail."""
    host = action.host or pod_ip
    try:
        if isinstance(action, TcpSocket):
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, action.port), timeout_s)
            writer.close()
            return True
        url = f"{action.scheme.lower()}://{host}:{action.port}{action.path}"
        headers = {"User-Agent": USER_AGENT, **dict(action.headers)}
        async with session.get(
            url,
            headers=headers,
            ssl=False,
            allow_redirects=False,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as response:
            return 200 <= response.status < 400
    except (OSError, asyncio.TimeoutError, aiohttp.ClientError):
        return False


@dataclass
class ProbeVerdict:
    """The probe's standing result for the current container, from the checks recorded so far."""

    spec: ProbeSpec
    container_id: str | None = None
    value: bool | None = None
    on_hold: bool = False  # a failed liveness/startup verdict: no more checks until a new container
    _last: bool | None = field(default=None, repr=False)
    _run: int = field(default=0, repr=False)

    def follow(self, container_id: str) -> None:
        """A new container instance starts from the initial verdict (the run of checks carries on)."""
        if container_id != self.container_id:
            self.container_id = container_id
            self.value = INITIAL_VERDICT[self.spec.kind]
            self.on_hold = False

    @property
    def failures_in_a_row(self) -> int:
        return self._run if self._last is False else 0

    def record(self, passed: bool) -> bool | None:
        """Count one check; the verdict changes once the run reaches the threshold for its outcome."""
        if passed == self._last:
            self._run += 1
        else:
            self._last, self._run = passed, 1
        threshold = self.spec.success_threshold if passed else self.spec.failure_threshold
        if self._run >= threshold:
            self.value = passed
            if not passed and self.spec.kind in (LIVENESS, STARTUP):
                self.on_hold, self._run = True, 0
        return self.value
