"""Leader election on a Lease: who may take it when, conditional writes, release, and a leader that loses
it. The multi-process behaviour against the API-server harness is e2e/test_leader_election.py."""

from __future__ import annotations

import copy
import socket
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest
from polling import wait_until

from kvpilot.operator.kube_api import KubeApiError, ObjectRef
from kvpilot.operator.leader import LeaseLock, LeaseSettings, Renewer, campaign, standby_health


class LeaseApi:
    """Leases by name, with the API server's optimistic concurrency: a PUT whose resourceVersion is not the
    stored one is a 409."""

    def __init__(self) -> None:
        self.leases: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.failing = False
        self.before_replace: list[Any] = []  # callbacks run just before the next PUT is judged

    def _check(self) -> None:
        if self.failing:
            raise KubeApiError(503, "ServiceUnavailable", "the API server is away")

    def _store(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        stored = copy.deepcopy(obj)
        stored["metadata"]["resourceVersion"] = str(self.version)
        self.leases[stored["metadata"]["name"]] = stored
        return copy.deepcopy(stored)

    def get(self, ref: ObjectRef) -> dict[str, Any] | None:
        self._check()
        return copy.deepcopy(self.leases.get(ref.name or ""))

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        self._check()
        if obj["metadata"]["name"] in self.leases:
            raise KubeApiError(409, "AlreadyExists", "leases already exists")
        return self._store(obj)

    def replace(self, obj: dict[str, Any]) -> dict[str, Any]:
        self._check()
        while self.before_replace:
            self.before_replace.pop()()
        current = self.leases[obj["metadata"]["name"]]
        if obj["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
            raise KubeApiError(409, "Conflict", "the object has been modified")
        return self._store(obj)

    def spec(self, name: str = "kvpilot-operator") -> dict[str, Any]:
        return self.leases[name]["spec"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def settings(identity: str, **timing: float) -> LeaseSettings:
    return LeaseSettings(namespace="kvpilot-system", identity=identity, **timing)


def test_the_first_candidate_creates_the_lease_and_renews_it():
    api, clock = LeaseApi(), Clock()
    lock = LeaseLock(api, settings("a"), clock)
    assert lock.try_acquire_or_renew() and lock.is_leader
    created = api.spec()
    assert (created["holderIdentity"], created["leaseDurationSeconds"], created["leaseTransitions"]) == (
        "a",
        15,
        0,
    )
    clock.now += 2
    assert lock.try_acquire_or_renew()
    renewed = api.spec()
    assert renewed["acquireTime"] == created["acquireTime"] and renewed["leaseTransitions"] == 0
    assert api.leases["kvpilot-operator"]["metadata"]["namespace"] == "kvpilot-system"


def test_a_held_lease_is_taken_only_after_it_went_unrenewed_for_its_duration():
    api, clock = LeaseApi(), Clock()
    holder = LeaseLock(api, settings("a"), clock)
    candidate = LeaseLock(api, settings("b"), clock)
    assert holder.try_acquire_or_renew()
    assert not candidate.try_acquire_or_renew()
    for _ in range(20):  # the holder renews every 2 s: the candidate never gets it
        clock.now += 2
        assert holder.try_acquire_or_renew()
        assert not candidate.try_acquire_or_renew()
    clock.now += 14.9  # the holder stopped renewing; not yet 15 s since the candidate saw it change
    assert not candidate.try_acquire_or_renew()
    clock.now += 0.2
    assert candidate.try_acquire_or_renew() and candidate.is_leader
    taken = api.spec()
    assert (taken["holderIdentity"], taken["leaseTransitions"]) == ("b", 1)
    # the old holder, back, sees another holder: it is not the leader any more
    assert not holder.try_acquire_or_renew() and not holder.is_leader


def test_expiry_is_judged_on_the_candidates_clock_not_the_holders_renew_time():
    """A renewTime far in the past (a holder whose wall clock is behind) does not make the lease expired:
    only a record that stops changing does."""
    api, clock = LeaseApi(), Clock()
    assert LeaseLock(api, settings("a"), clock).try_acquire_or_renew()
    api.leases["kvpilot-operator"]["spec"]["renewTime"] = "2001-01-01T00:00:00.000000Z"
    assert not LeaseLock(api, settings("b"), clock).try_acquire_or_renew()


def test_of_two_candidates_that_read_the_same_version_only_one_writes():
    api, clock = LeaseApi(), Clock()
    assert LeaseLock(api, settings("old"), clock).try_acquire_or_renew()
    first = LeaseLock(api, settings("b"), clock)
    second = LeaseLock(api, settings("c"), clock)
    assert not first.try_acquire_or_renew() and not second.try_acquire_or_renew()
    clock.now += 16  # expired for both
    api.before_replace.append(
        first.try_acquire_or_renew
    )  # the first writes between the second's read and write
    assert not second.try_acquire_or_renew()  # its write carried the version it had read: 409
    assert api.spec()["holderIdentity"] == "b" and first.is_leader and not second.is_leader


def test_a_released_lease_is_taken_at_the_next_round():
    api, clock = LeaseApi(), Clock()
    holder = LeaseLock(api, settings("a"), clock)
    candidate = LeaseLock(api, settings("b"), clock)
    assert holder.try_acquire_or_renew() and not candidate.try_acquire_or_renew()
    holder.release()
    assert api.spec()["holderIdentity"] == ""
    assert candidate.try_acquire_or_renew()
    holder.release()  # no longer ours: left alone
    assert api.spec()["holderIdentity"] == "b"


def test_campaign_returns_once_the_lease_is_free_or_when_stopped():
    api = LeaseApi()
    fast = {"duration_s": 0.3, "renew_deadline_s": 0.2, "retry_period_s": 0.02}
    assert LeaseLock(api, settings("a", **fast)).try_acquire_or_renew()
    stop = threading.Event()
    stop.set()
    assert campaign(LeaseLock(api, settings("b", **fast)), stop) is False
    assert campaign(LeaseLock(api, settings("b", **fast))) is True
    assert api.spec()["holderIdentity"] == "b"


@pytest.mark.parametrize("cause", ["api-unreachable", "taken-over"])
def test_a_leader_that_cannot_renew_is_told_to_stop(cause: str):
    api = LeaseApi()
    fast = {"duration_s": 0.5, "renew_deadline_s": 0.2, "retry_period_s": 0.02}
    lock = LeaseLock(api, settings("a", **fast))
    assert lock.try_acquire_or_renew()
    lost = threading.Event()
    renewer = Renewer(lock, on_lost=lost.set)
    renewer.start()
    wait_until(lambda: api.version >= 3, what="two renewals")
    assert not lost.is_set()
    if cause == "api-unreachable":
        api.failing = True
    else:
        api.leases["kvpilot-operator"]["spec"]["holderIdentity"] = "b"
    wait_until(lost.is_set, timeout_s=5, what="the leader told to stop")
    renewer.join(5)
    assert not renewer.is_alive()


def test_lease_timing_must_leave_room_to_stop_before_expiry():
    with pytest.raises(ValueError, match="retry-period < --lease-renew-deadline < --lease-duration"):
        settings("a", duration_s=10, renew_deadline_s=10)
    with pytest.raises(ValueError, match="namespace"):
        LeaseSettings(namespace="", identity="a")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_standby_answers_the_liveness_probe_until_it_leads():
    port = _free_port()
    url = f"http://127.0.0.1:{port}/healthz"
    with standby_health(url):
        with urllib.request.urlopen(url, timeout=5) as response:
            assert (response.status, response.read()) == (200, b'{"standby": true}')
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=5)
        assert missing.value.code == 404
    with socket.socket() as rebind:  # the port is free again for Kopf's liveness endpoint, bound as
        rebind.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # asyncio's servers bind on Linux
        rebind.bind(("127.0.0.1", port))
        rebind.listen()
