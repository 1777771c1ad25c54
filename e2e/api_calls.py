"""Measure the operator's API calls per InferenceService per minute at steady state, on the e2e harness.

    .venv/bin/python e2e/api_calls.py --services 10 --window 60 [-- extra `kvpilot operator run` flags]

Starts a harness cluster (fake pods, all Ready), one ``kvpilot operator run --all-namespaces
--standalone`` with the operator's default intervals unless flags say otherwise, applies ``--services``
InferenceServices (one namespace each), waits until every one is Ready, then counts the requests the API
server receives during ``--window`` seconds. The workload controllers run inside the harness and send no
requests, so every request counted is the operator's. Printed: requests in the services' namespaces per
service per minute (what grows with the number of services), watch requests opened in the window and the
cluster-scoped rest (the operator's own, independent of the number of services).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from harness.cluster import HarnessCluster

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
ISVC = "kvpilot.dev/v1alpha1/inferenceservices"


def _manifest(namespace: str) -> str:
    return (
        "apiVersion: kvpilot.dev/v1alpha1\nkind: InferenceService\n"
        f"metadata: {{name: smol, namespace: {namespace}}}\n"
        "spec:\n  model: {source: smollm2-135m}\n  scaling: {replicas: 1}\n"
    )


def _kubectl(cluster: HarnessCluster, *args: str, stdin: str | None = None) -> None:
    subprocess.run(
        [str(VENV_BIN / "kubectl"), "--kubeconfig", str(cluster.kubeconfig), *args],
        input=stdin,
        text=True,
        check=True,
        capture_output=True,
    )


def _classify(
    cluster: HarnessCluster, since: int, namespaces: set[str]
) -> tuple[dict[str, int], Counter[str]]:
    counts = {"namespaced": 0, "watches": 0, "cluster": 0}
    kinds: Counter[str] = Counter()  # "GET deployments", "PATCH inferenceservices/status", ...
    for request in list(cluster.api)[since:]:
        if request.params.get("watch") in ("true", "1"):
            counts["watches"] += 1
        elif any(f"/namespaces/{namespace}/" in request.url.path for namespace in namespaces):
            counts["namespaced"] += 1
            parts = request.url.path.split("/namespaces/", 1)[1].split("/")
            what = parts[1] + ("/" + parts[3] if len(parts) > 3 else "")
            kinds[f"{request.method.value} {what}"] += 1
        else:
            counts["cluster"] += 1
    return counts, kinds


def measure(services: int, window_s: float, operator_flags: list[str]) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="kvpilot-api-calls-"))
    cluster = HarnessCluster(workdir).start()
    log = (workdir / "operator.log").open("w")
    command = [str(VENV_BIN / "kvpilot"), "operator", "run", "--all-namespaces", "--standalone"]
    operator = subprocess.Popen(
        [*command, "--log-format", "plain", *operator_flags],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={"KUBECONFIG": str(cluster.kubeconfig), "PATH": str(VENV_BIN)},
    )
    try:
        _kubectl(cluster, "apply", "-f", str(REPO / "crds" / "inferenceservices.kvpilot.dev.yaml"))
        namespaces = {f"load-{index}" for index in range(services)}
        for namespace in sorted(namespaces):
            cluster.create_namespace(namespace)
            _kubectl(cluster, "apply", "-f", "-", stdin=_manifest(namespace))
        cluster.wait_for(
            f"{services} services Ready",
            lambda: all(
                (cluster.get(ISVC, ns, "smol") or {}).get("status", {}).get("phase") == "Ready"
                for ns in namespaces
            ),
            timeout=120,
        )
        start = len(list(cluster.api))
        time.sleep(window_s)  # the measurement window itself, not a synchronisation
        counts, kinds = _classify(cluster, start, namespaces)
    finally:
        operator.terminate()
        operator.wait(15)
        log.close()
        cluster.stop()
    minutes = window_s / 60
    return {
        "per_service_per_minute": counts["namespaced"] / services / minutes,
        "watches_opened": counts["watches"],
        "cluster_scoped_per_minute": counts["cluster"] / minutes,
        "by_kind": {kind: count / services / minutes for kind, count in sorted(kinds.items())},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=10)
    parser.add_argument("--window", type=float, default=60.0, metavar="SECONDS")
    parser.add_argument("operator_flags", nargs="*", help="after --: flags for `kvpilot operator run`")
    args = parser.parse_args()
    result = measure(args.services, args.window, args.operator_flags)
    print(
        f"{args.services} services, {args.window:g} s window: "
        f"{result['per_service_per_minute']:.1f} requests per service per minute; "
        f"{result['watches_opened']} watch requests opened; "
        f"{result['cluster_scoped_per_minute']:.1f} cluster-scoped requests per minute"
    )
    for kind, rate in result["by_kind"].items():
        print(f"  {kind}: {rate:.2f} per service per minute")
    return 0


if __name__ == "__main__":
    sys.exit(main())
