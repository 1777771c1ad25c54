"""The process kubelet on its own: restart back-off and probe verdicts (pure), how a container becomes a
command line, and ``ProcessPodRunner`` running small Python HTTP servers as containers (probes, restarts,
liveness kills, SIGTERM then SIGKILL on deletion, init containers, refused pod features)."""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness.cluster import HarnessCluster, claim_ip_prefix
from harness.container_launch import MissingSecret, build_launch, empty_dirs, expand, resolve_secret_env
from harness.container_supervisor import RestartBackoff
from harness.probes import LIVENESS, READINESS, HttpGet, ProbeSpec, ProbeVerdict, UnsupportedPod, parse_probe
from harness.process_runner import ProcessPodRunner

pytestmark = pytest.mark.e2e

# A container: an HTTP server answering /health (200) and /ready (503 until --ready-after seconds).
CONTAINER_SCRIPT = """
import argparse, http.server, os, signal, subprocess, sys, threading, time
parser = argparse.ArgumentParser()
for flag in ("--host", "--port", "--ready-after", "--exit-after", "--exit-code"):
    parser.add_argument(flag, type=str if flag == "--host" else float)
parser.add_argument("--ignore-sigterm", action="store_true")
parser.add_argument("--spawn-child", action="store_true")
args = parser.parse_args()
began = time.monotonic()
signal.signal(signal.SIGTERM, signal.SIG_IGN if args.ignore_sigterm else lambda *_: sys.exit(0))
if args.spawn_child:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open("child.pid", "w").write(str(child.pid))
if args.exit_after is not None:
    threading.Timer(args.exit_after, lambda: os._exit(int(args.exit_code))).start()
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ready = time.monotonic() - began >= (args.ready_after or 0)
        self.send_response({"/health": 200, "/ready": 200 if ready else 503}.get(self.path, 404))
        self.end_headers()
    def log_message(self, *_):
        pass
http.server.HTTPServer((args.host, int(args.port)), Handler).serve_forever()
"""


# ---- pure parts ---------------------------------------------------------------------------------------
def test_restart_back_off_doubles_to_five_minutes_and_resets_after_ten_minutes_of_running():
    backoff, now, delays = RestartBackoff(), 0.0, []
    for _ in range(8):  # a container that crashes the moment it starts
        delay = backoff.delay(finished=now, now=now)
        delays.append(delay)
        now += delay
        backoff.restarting(finished=now, now=now)
    assert delays == [0, 10, 20, 40, 80, 160, 300, 300]
    assert backoff.delay(finished=now + 601, now=now + 601) == 0  # ran 10 minutes: starts over
    backoff.restarting(finished=now + 601, now=now + 601)
    assert backoff.current == 10
    assert backoff.delay(finished=now + 602, now=now + 606) == 6  # part of the back-off already waited


def test_probe_verdicts_need_a_run_of_results_and_hold_after_a_failed_liveness_probe():
    readiness = ProbeVerdict(ProbeSpec(READINESS, HttpGet(8000), success_threshold=2, failure_threshold=2))
    readiness.follow("c1")
    assert readiness.value is False  # readiness starts failed
    assert [readiness.record(r) for r in (True, True, False, True, False, False)] == [
        False,
        True,
        True,
        True,
        True,
        False,
    ]
    liveness = ProbeVerdict(ProbeSpec(LIVENESS, HttpGet(8000), failure_threshold=3))
    liveness.follow("c1")
    assert [liveness.record(r) for r in (False, False, True, False, False)] == [True, True, True, True, True]
    assert liveness.record(False) is False and liveness.on_hold
    liveness.follow("c1")
    assert liveness.on_hold  # the same container stays on hold
    liveness.follow("c2")
    assert (liveness.value, liveness.on_hold) == (True, False)


def test_probe_specs_get_the_api_defaults_and_resolve_named_ports():
    container = {
        "name": "engine",
        "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}},
        "livenessProbe": {"exec": {"command": ["true"]}},
    }
    assert parse_probe(READINESS, container) == ProbeSpec(READINESS, HttpGet(8000, "/ready"))
    assert parse_probe("startup", container) is None
    with pytest.raises(UnsupportedPod, match="livenessProbe: only httpGet and tcpSocket probes are emulated"):
        parse_probe(LIVENESS, container)


def test_a_container_becomes_a_command_line_on_the_pod_address(tmp_path):
    pod = {
        "metadata": {"name": "p-1"},
        "status": {"podIP": "127.1.2.3"},
        "spec": {
            "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "model", "persistentVolumeClaim": {}}]
        },
    }
    container = {
        "name": "engine",
        "command": ["kvpilot", "serve"],
        "ports": [{"containerPort": 8000}],
        "args": ["--download-dir", "/tmp/models", "--seed", "$(SEED)", "--price", "$$(SEED)"],
        "env": [{"name": "HOME", "value": "/tmp"}, {"name": "SEED", "value": "7"}],
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    volumes = empty_dirs(pod, tmp_path)
    launch = build_launch(pod, container, tmp_path, volumes, tmp_path / "kubeconfig")
    scratch = str(tmp_path / "volumes" / "tmp")
    assert launch.argv == [
        str(Path(sys.executable).parent / "kvpilot"),
        "serve",
        "--download-dir",
        f"{scratch}/models",
        "--seed",
        "7",
        "--price",
        "$(SEED)",
        "--host",
        "127.1.2.3",
    ]
    assert (launch.env["HOME"], launch.env["KUBECONFIG"], launch.cwd) == (
        scratch,
        str(tmp_path / "kubeconfig"),
        tmp_path,
    )
    assert launch.env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    wildcard = build_launch(pod, {**container, "args": ["--host", "0.0.0.0"]}, tmp_path, volumes, tmp_path)
    assert wildcard.argv[2:] == ["--host", "127.1.2.3"]
    assert expand("$(A)-$(B)", {"A": "1"}) == "1-$(B)"
    with pytest.raises(UnsupportedPod, match="mounts volume 'model' \\(persistentVolumeClaim\\)"):
        build_launch(
            pod,
            {**container, "volumeMounts": [{"name": "model", "mountPath": "/models"}]},
            tmp_path,
            volumes,
            tmp_path,
        )
    with pytest.raises(UnsupportedPod, match="env 'X': valueFrom"):
        build_launch(pod, {**container, "env": [{"name": "X", "valueFrom": {}}]}, tmp_path, volumes, tmp_path)


def test_secret_key_refs_become_the_stored_values_and_a_missing_secret_holds_the_pod():
    secrets = {("ns", "tok"): {"data": {"token": base64.b64encode(b"s3cret").decode()}}}

    def lookup(namespace: str, name: str) -> dict | None:
        return secrets.get((namespace, name))

    def ref(name: str, key: str = "token", **extra: bool) -> dict:
        return {"name": "T", "valueFrom": {"secretKeyRef": {"name": name, "key": key, **extra}}}

    def with_env(*env: dict) -> dict:
        return {
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {"containers": [{"name": "engine", "env": [{"name": "A", "value": "1"}, *env]}]},
        }

    manifest = with_env(ref("tok"))
    resolved = resolve_secret_env(manifest, lookup)
    assert resolved["spec"]["containers"][0]["env"] == [
        {"name": "A", "value": "1"},
        {"name": "T", "value": "s3cret"},
    ]
    assert "valueFrom" in manifest["spec"]["containers"][0]["env"][1]  # the stored pod is left as it was
    assert resolve_secret_env(with_env(ref("absent", optional=True)), lookup)["spec"]["containers"][0][
        "env"
    ] == [{"name": "A", "value": "1"}]
    with pytest.raises(MissingSecret, match="env 'T': secret \"absent\" not found"):
        resolve_secret_env(with_env(ref("absent")), lookup)
    with pytest.raises(MissingSecret, match='key "other" in secret "tok" not found'):
        resolve_secret_env(with_env(ref("tok", key="other")), lookup)
    other = {"name": "X", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}
    assert (
        resolve_secret_env(with_env(other), lookup)["spec"]["containers"][0]["env"][1] == other
    )  # refused later


def test_the_kubelet_loop_starts_a_pod_once_its_secret_exists_with_the_value_in_the_process_env(
    tmp_path, caplog
):
    """The operator's pods read the router token from a Secret: the real processes must see its value."""
    import kmock

    caplog.set_level(logging.INFO, logger="harness.workloads")
    runner = ProcessPodRunner(tmp_path / "pods", tmp_path / "kubeconfig")
    cluster = HarnessCluster(tmp_path, runner=runner).start()
    try:
        write_env = "import os, time; open('token.txt', 'w').write(os.environ['TOKEN']); time.sleep(60)"
        pod_manifest = {
            "metadata": {"name": "reader"},
            "spec": {
                "terminationGracePeriodSeconds": 1,
                "containers": [
                    {
                        "name": "app",
                        "image": "unused",
                        "command": [sys.executable, "-c", write_env],
                        "env": [
                            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "tok", "key": "token"}}}
                        ],
                    }
                ],
            },
        }
        cluster.call(cluster.api.create(kmock.resource("", "v1", "pods"), "default", pod_manifest))
        cluster.wait_for(
            "the kubelet to hold the pod back for its Secret",
            lambda: any(
                "pod default/reader waits:" in r.getMessage() and 'secret "tok" not found' in r.getMessage()
                for r in caplog.records
            ),
            timeout=10,
            interval=0.02,
        )  # the kubelet has seen the pod and decided: it waits, without an address, nothing started
        assert not cluster.get("v1/pods", "default", "reader").get("status", {}).get("podIP")
        assert runner.containers("default") == []
        cluster.call(
            cluster.api.create(
                kmock.resource("", "v1", "secrets"),
                "default",
                {
                    "metadata": {"name": "tok"},
                    "type": "Opaque",
                    "data": {"token": base64.b64encode(b"ab" * 32).decode()},
                },
            )
        )
        written = tmp_path / "pods" / "default" / "reader" / "token.txt"
        cluster.wait_for(
            "the container wrote its env", lambda: written.exists() and written.read_text(), timeout=10
        )
        assert written.read_text() == "ab" * 32
    finally:
        try:
            cluster.stop()
        finally:
            runner.kill_all()


# ---- the runner with real processes -------------------------------------------------------------------
@pytest.fixture(scope="module")
def addresses() -> Iterator[Iterator[str]]:
    prefix, lock = claim_ip_prefix()
    yield iter(f"{prefix}.{n}" for n in range(2, 255))
    os.close(lock)


@pytest.fixture()
def script(tmp_path: Path) -> Path:
    path = tmp_path / "container.py"
    path.write_text(CONTAINER_SCRIPT)
    return path


def pod(
    name: str, ip: str, script: Path, containers: dict[str, list[str]], grace: float = 30, **probes: dict
) -> dict:
    return {
        "metadata": {"name": name, "namespace": "kubelet", "uid": f"uid-{name}"},
        "status": {"podIP": ip},
        "spec": {
            "terminationGracePeriodSeconds": grace,
            "containers": [
                {
                    "name": container,
                    "image": "unused",
                    "command": [sys.executable, str(script)],
                    "args": ["--port", str(8000 + index), *args],
                    "ports": [{"name": "http", "containerPort": 8000 + index}],
                    **probes,
                }
                for index, (container, args) in enumerate(containers.items())
            ],
        },
    }


async def observe(
    runner: ProcessPodRunner, manifest: dict, until: Callable[[dict], bool], timeout: float = 10
) -> list[dict]:
    """Pod statuses every 20 ms until ``until`` holds for one; all of them, in order."""
    seen, deadline = [], time.monotonic() + timeout
    while not seen or not until(seen[-1]):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; last status: {seen[-1] if seen else None}")
        seen.append(runner.status(manifest, seen[-1] if seen else {"podIP": manifest["status"]["podIP"]}))
        await asyncio.sleep(0.02)
    return seen


def container(status: dict, index: int = 0) -> dict:
    return status["containerStatuses"][index]


def pid_of(status: dict, index: int = 0) -> int:
    return int(container(status, index)["containerID"].removeprefix("process://"))


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def seconds_until_gone(pids: list[int], since: float, timeout: float = 10) -> float:
    while not all(gone(pid) for pid in pids):
        if time.monotonic() - since > timeout:
            raise AssertionError(f"processes {[p for p in pids if not gone(p)]} still alive after {timeout}s")
        await asyncio.sleep(0.02)
    return time.monotonic() - since


async def test_startup_and_readiness_probes_gate_started_and_ready(tmp_path, addresses, script):
    runner = ProcessPodRunner(tmp_path / "pods", tmp_path / "kubeconfig")
    probes = {
        "startupProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 1,
            "failureThreshold": 5,
            "initialDelaySeconds": 2,
        },
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1},
    }
    manifest = pod("gated", next(addresses), script, {"app": ["--ready-after", "4"]}, **probes)
    try:
        began = time.monotonic()
        await runner.start(manifest)
        started = await observe(runner, manifest, lambda s: container(s)["started"])
        started_s = time.monotonic() - began
        seen = started + await observe(runner, manifest, lambda s: container(s)["ready"])
        stages = [(container(s)["started"], container(s)["ready"]) for s in seen]
        # the server answers /health at once, but the startup probe waits out its initial delay; /ready
        # turns 200 later, and the readiness probe notices on its next tick
        assert 2.0 <= started_s < 4.5, started_s
        assert stages[0] == (False, False) and (True, False) in stages and stages[-1] == (True, True)
        conditions = {c["type"]: c["status"] for c in seen[-1]["conditions"]}
        assert (seen[-1]["phase"], conditions["Ready"], conditions["ContainersReady"]) == (
            "Running",
            "True",
            "True",
        )
        assert not gone(pid_of(seen[-1]))
    finally:
        await runner.close()
    assert gone(pid_of(seen[-1]))


async def test_an_exited_container_restarts_at_once_then_backs_off(tmp_path, addresses, script):
    runner = ProcessPodRunner(tmp_path / "pods", tmp_path / "kubeconfig")
    manifest = pod("crashy", next(addresses), script, {"app": ["--exit-after", "0.2", "--exit-code", "3"]})
    try:
        await runner.start(manifest)
        seen = await observe(
            runner,
            manifest,
            lambda s: container(s)["state"].get("waiting", {}).get("reason") == "CrashLoopBackOff",
        )
        restarted = container(seen[-1])
        assert restarted["restartCount"] == 1  # the first exit restarted at once, the second waits
        assert restarted["state"]["waiting"]["reason"] == "CrashLoopBackOff"
        assert "back-off 10s restarting failed container=app" in restarted["state"]["waiting"]["message"]
        assert (
            restarted["lastState"]["terminated"]["exitCode"],
            restarted["lastState"]["terminated"]["reason"],
        ) == (3, "Error")
        assert seen[-1]["phase"] == "Running" and not restarted["ready"]
        assert len(runner.containers("kubelet")[0].pids) == 2
    finally:
        await runner.close()


async def test_a_failed_liveness_probe_restarts_the_container(tmp_path, addresses, script):
    runner = ProcessPodRunner(tmp_path / "pods", tmp_path / "kubeconfig")
    liveness = {
        "livenessProbe": {
            "httpGet": {"path": "/missing", "port": "http"},
            "periodSeconds": 1,
            "failureThreshold": 2,
        }
    }
    manifest = pod("unwell", next(addresses), script, {"app": []}, **liveness)
    try:
        await runner.start(manifest)
        seen = await observe(
            runner,
            manifest,
            lambda s: container(s)["restartCount"] == 1 and "running" in container(s)["state"],
        )
        first, second = runner.containers("kubelet")[0].pids
        assert gone(first) and not gone(second) and pid_of(seen[-1]) == second
        assert container(seen[-1])["lastState"]["terminated"]["exitCode"] == 0  # it took the SIGTERM and left
    finally:
        await runner.close()


async def test_deletion_sends_sigterm_and_sigkills_what_outlives_the_grace_period(
    tmp_path, addresses, script
):
    runner = ProcessPodRunner(tmp_path / "pods", tmp_path / "kubeconfig")
    readiness = {"readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1}}
    manifest = pod(
        "leaving",
        next(addresses),
        script,
        grace=1.5,
        containers={"polite": [], "stubborn": ["--ignore-sigterm", "--spawn-child"]},
        **readiness,
    )
    try:
        await runner.start(manifest)
        child_pid_file = tmp_path / "pods" / "kubelet" / "leaving" / "child.pid"
        # both serving (their SIGTERM handling is in place), the stubborn one's child started
        seen = await observe(
            runner,
            manifest,
            lambda s: all(c["ready"] for c in s["containerStatuses"]) and child_pid_file.exists(),
        )
        polite, stubborn, child = pid_of(seen[-1], 0), pid_of(seen[-1], 1), int(child_pid_file.read_text())
        began = time.monotonic()
        await runner.stop(manifest)
        polite_s = await seconds_until_gone([polite], began)
        stubborn_s = await seconds_until_gone([stubborn, child], began)
        assert polite_s < 1.0, polite_s  # it exits on SIGTERM
        assert 1.5 <= stubborn_s < 4.0, stubborn_s  # SIGKILL once the grace period is over, its child too
        states = [c.state["terminated"]["exitCode"] for c in runner.containers("kubelet")]
        assert states == [0, 137]  # SIGKILL, as a runtime reports it: 128 + 9
    finally:
        await runner.close()


async def test_pod_features_that_are_not_emulated_are_reported_not_run(tmp_path, addresses, script):
    runner = ProcessPodRunner(tmp_path / "pods", tmp_path / "kubeconfig")
    manifest = pod("pvc", next(addresses), script, {"app": []})
    manifest["spec"]["volumes"] = [{"name": "model", "persistentVolumeClaim": {"claimName": "weights"}}]
    manifest["spec"]["containers"][0]["volumeMounts"] = [{"name": "model", "mountPath": "/models"}]
    try:
        await runner.start(manifest)
        status = runner.status(manifest, {"podIP": manifest["status"]["podIP"]})
        waiting = container(status)["state"]["waiting"]
        assert (status["phase"], waiting["reason"]) == ("Pending", "CreateContainerConfigError")
        assert "volume 'model' (persistentVolumeClaim)" in waiting["message"]
        assert runner.containers("kubelet")[0].pids == []
    finally:
        await runner.close()


# An init container: fails on its first run (its last line saying why), succeeds on the next, leaving a
# file in the emptyDir for the pod's container.
INIT_SCRIPT = """
import pathlib, sys
cache = pathlib.Path(sys.argv[1])
marker = cache / "attempted"
if not marker.exists():
    marker.write_text("1")
    print("fetching")
    print("model fetch failed: the mirror said no", file=sys.stderr)
    sys.exit(1)
(cache / "model.gguf").write_text("weights")
"""


async def test_init_containers_run_to_success_before_the_pods_containers(tmp_path, addresses, script):
    runner = ProcessPodRunner(tmp_path / "pods", tmp_path / "kubeconfig")
    init_script = tmp_path / "init.py"
    init_script.write_text(INIT_SCRIPT)
    manifest = pod("initialized", next(addresses), script, {"app": []})
    manifest["spec"]["volumes"] = [{"name": "cache", "emptyDir": {}}]
    manifest["spec"]["initContainers"] = [
        {
            "name": "fetch",
            "image": "unused",
            "command": [sys.executable, str(init_script)],
            "args": ["/cache"],
            "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
            "terminationMessagePolicy": "FallbackToLogsOnError",
        }
    ]
    try:
        await runner.start(manifest)
        seen = await observe(
            runner, manifest, lambda s: "running" in container(s)["state"], timeout=30
        )  # the first exit restarts at once, as for any container
        failed = next(s for s in seen if s.get("initContainerStatuses", [{}])[0].get("lastState"))
        (init,) = failed["initContainerStatuses"]
        assert init["lastState"]["terminated"]["exitCode"] == 1
        # the end of its output is the termination message; the kubelet's own log lines are not in it
        assert (
            init["lastState"]["terminated"]["message"] == "fetching\nmodel fetch failed: the mirror said no"
        )
        initialized = {"type": "Initialized", "status": "True"}
        waiting = [s for s in seen if not any(c.items() >= initialized.items() for c in s["conditions"])]
        assert waiting and all(
            container(s)["state"] == {"waiting": {"reason": "PodInitializing"}} for s in waiting
        )
        assert all(s["phase"] == "Pending" for s in waiting)
        done = seen[-1]
        assert done["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
        assert done["initContainerStatuses"][0]["restartCount"] == 1
        assert {c["type"]: c["status"] for c in done["conditions"]}["Initialized"] == "True"
        assert (tmp_path / "pods" / "kubelet" / "initialized" / "volumes" / "cache" / "model.gguf").exists()
        assert len(runner.containers("kubelet")) == 2  # fetch and app
    finally:
        await runner.close()
