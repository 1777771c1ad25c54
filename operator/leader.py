"""Leader election on a ``coordination.k8s.io/v1`` Lease, so that of several operator replicas exactly one
reconciles (docs/architecture.md#leader-election).

client-go's algorithm, reduced to what one process needs:

- a candidate reads the Lease; it may take it when nobody holds it, or when the holder's record has not
  changed for ``leaseDurationSeconds`` *as observed on the candidate's own monotonic clock* (never by
  comparing ``renewTime`` with its wall clock: nodes' clocks differ);
- every write is a PUT carrying the resourceVersion that was read, so of two candidates that both saw
  an expired Lease the API server accepts one and answers 409 to the other;
- the leader renews every ``retry_period``; when no renewal has succeeded for ``renew_deadline`` (shorter
  than the lease duration) it must stop reconciling at once: by then another candidate may be about to
  take over. On an orderly exit the leader releases the Lease (empty holder), so a standby takes over
  within one retry period instead of a whole lease duration.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import math
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kvpilot.operator.kube_api import KubeApi, KubeApiError, ObjectRef

log = logging.getLogger(__name__)
LEASE_API_VERSION = "coordination.k8s.io/v1"


@dataclass(frozen=True)
class LeaseSettings:
    namespace: str
    identity: str
    name: str = "kvpilot-operator"
    duration_s: float = 15.0  # client-go's defaults: 15 s lease, 10 s renew deadline, 2 s retry period
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period_s < self.renew_deadline_s < self.duration_s < math.inf:
            raise ValueError(
                "leader election needs 0 < --lease-retry-period < --lease-renew-deadline < --lease-duration"
            )
        if not self.namespace or not self.identity:
            raise ValueError("leader election needs a Lease namespace and an identity")

    @property
    def ref(self) -> ObjectRef:
        return ObjectRef(LEASE_API_VERSION, "Lease", self.namespace, self.name)


def micro_time(moment: datetime | None = None) -> str:
    """A Kubernetes MicroTime (RFC 3339 with microseconds, UTC)."""
    return (moment or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseLock:
    """One candidate's view of the Lease. ``try_acquire_or_renew`` is one round: a GET, then at most one
    write; it never blocks on anything else and reports the outcome as a bool."""

    def __init__(
        self, api: KubeApi, settings: LeaseSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.api, self.settings, self._clock = api, settings, clock
        self._observed: dict[str, Any] | None = None  # the holder's record as last seen
        self._observed_at = 0.0  # when it last changed, on our clock

    def _observe(self, spec: dict[str, Any]) -> None:
        if spec != self._observed:
            self._observed, self._observed_at = dict(spec), self._clock()

    def _held_by_another(self, spec: dict[str, Any]) -> bool:
        holder = spec.get("holderIdentity") or ""
        if not holder or holder == self.settings.identity:
            return False
        duration = float(spec.get("leaseDurationSeconds") or self.settings.duration_s)
        return self._clock() < self._observed_at + duration

    def _spec(self, previous: dict[str, Any]) -> dict[str, Any]:
        now = micro_time()
        mine = previous.get("holderIdentity") == self.settings.identity
        transitions = int(previous.get("leaseTransitions") or 0)
        return {
            "holderIdentity": self.settings.identity,
            "leaseDurationSeconds": math.ceil(self.settings.duration_s),
            "acquireTime": previous.get("acquireTime", now) if mine else now,
            "renewTime": now,
            "leaseTransitions": transitions if mine or not previous else transitions + 1,
        }

    def try_acquire_or_renew(self) -> bool:
        ref = self.settings.ref
        try:
            lease = self.api.get(ref)
            if lease is None:
                spec = self._spec({})
                self.api.create(
                    {
                        "apiVersion": LEASE_API_VERSION,
                        "kind": "Lease",
                        "metadata": {"name": ref.name, "namespace": ref.namespace},
                        "spec": spec,
                    }
                )
                self._observe(spec)
                return True
            spec = lease.get("spec") or {}
            self._observe(spec)
            if self._held_by_another(spec):
                return False
            new_spec = self._spec(spec)
            self.api.replace({**lease, "spec": new_spec})  # carries the resourceVersion just read
            self._observe(new_spec)
            return True
        except KubeApiError as error:
            if error.status != 409:  # 409: another candidate wrote first; not an error, just not us
                log.warning("lease %s/%s: %s", ref.namespace, ref.name, error)
            return False

    @property
    def is_leader(self) -> bool:
        observed = self._observed or {}
        return observed.get("holderIdentity") == self.settings.identity

    def release(self) -> None:
        """Give the Lease up (only if still ours): candidates take it at their next round."""
        try:
            lease = self.api.get(self.settings.ref)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.settings.identity:
                return
            spec = {
                **lease["spec"],
                "holderIdentity": "",
                "leaseDurationSeconds": 1,
                "renewTime": micro_time(),
            }
            self.api.replace({**lease, "spec": spec})
            log.info("released lease %s/%s", lease["metadata"]["namespace"], lease["metadata"]["name"])
        except KubeApiError as error:
            log.warning("could not release the lease (it expires by itself): %s", error)


def campaign(lock: LeaseLock, stop: threading.Event | None = None) -> bool:
    """Block until ``lock`` is ours (True), or ``stop`` is set (False); one round per retry period."""
    stop = stop or threading.Event()
    settings = lock.settings
    log.info("waiting to lead: lease %s/%s as %s", settings.namespace, settings.name, settings.identity)
    while not stop.is_set():
        if lock.try_acquire_or_renew():
            log.info("leading: lease %s/%s held by %s", settings.namespace, settings.name, settings.identity)
            return True
        stop.wait(settings.retry_period_s)
    return False


class Renewer(threading.Thread):
    """Renews the Lease every retry period; ``on_lost`` runs (once, in this thread) when no renewal has
    succeeded for the renew deadline. A thread, not a task on Kopf's loop: renewing must not wait for a
    busy event loop, and losing the lease must act even if that loop is stuck."""

    def __init__(
        self, lock: LeaseLock, on_lost: Callable[[], None], clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(name="lease-renewer", daemon=True)
        self.lock, self.on_lost, self._clock = lock, on_lost, clock
        self.stopping = threading.Event()

    def run(self) -> None:
        settings = self.lock.settings
        renewed = self._clock()
        while not self.stopping.wait(settings.retry_period_s):
            if self.lock.try_acquire_or_renew():
                renewed = self._clock()
                continue
            if not self.lock.is_leader:  # another candidate holds it now: stop at once
                log.error(
                    "lost the lease %s/%s to another candidate; stopping", settings.namespace, settings.name
                )
            elif self._clock() - renewed >= settings.renew_deadline_s:
                log.error(
                    "lost the lease %s/%s: no renewal for %gs; stopping",
                    settings.namespace,
                    settings.name,
                    settings.renew_deadline_s,
                )
            else:
                continue
            self.on_lost()
            return


class StandbyHealthError(OSError):
    """The standby's liveness address cannot be bound (taken, or not this host's)."""


@contextlib.contextmanager
def standby_health(url: str | None) -> Iterator[None]:
    """While a replica waits to lead, Kopf (and its liveness endpoint) has not started: answer the liveness
    probe at ``url`` (Kopf's ``--liveness`` address) meanwhile, so that a standby is not restarted for
    waiting. The port is closed again before Kopf binds it."""
    if url is None:
        yield
        return
    parts = urllib.parse.urlsplit(url)
    path = parts.path or "/"

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the stdlib calls the handler by this name
            found = urllib.parse.urlsplit(self.path).path == path
            body = b'{"standby": true}' if found else b""
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # probes every 30 s: not worth a line
            return

    address = (parts.hostname or "127.0.0.1", parts.port or 80)
    try:
        server = http.server.ThreadingHTTPServer(address, Health)
    except OSError as error:
        raise StandbyHealthError(
            f"cannot listen on {address[0]}:{address[1]} for --liveness: {error}"
        ) from None
    thread = threading.Thread(target=server.serve_forever, name="standby-health", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
