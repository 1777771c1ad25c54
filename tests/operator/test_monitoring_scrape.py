"""A real Prometheus scrapes the operator's real metrics the way the chart's ServiceMonitor says, and the
dashboard's desired-vs-ready panel and the replica alert find the series by the InferenceService's namespace.

The Prometheus Operator turns a ServiceMonitor endpoint into a scrape config: target labels from service
discovery (``namespace`` = the operator's namespace, ``pod``, ``service``...), ``honor_labels`` from
``honorLabels`` (forced off by a Prometheus with ``overrideHonorLabels``) and ``metric_relabel_configs``
from ``metricRelabelings``. This test writes that scrape config by hand from the rendered ServiceMonitor,
with the discovered labels as static target labels, and compares with an endpoint that has neither setting:
there the series' own ``namespace`` becomes ``exported_namespace`` and the panel is empty.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import start_http_server

from kvpilot.operator import metrics

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvpilot"
RELABEL_KEYS = {
    "sourceLabels": "source_labels",
    "separator": "separator",
    "targetLabel": "target_label",
    "regex": "regex",
    "modulus": "modulus",
    "replacement": "replacement",
    "action": "action",
}
OPERATOR_NAMESPACE = "kvpilot-system"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def binary(name: str) -> str:
    local = REPO / ".tools" / "bin" / name
    found = str(local) if local.exists() else shutil.which(name)
    if found is None:
        pytest.fail(
            f"{name} is missing: run `bash scripts/setup.sh` (helm; prometheus from Debian)", pytrace=False
        )
    return found


def service_monitor_endpoint(*values: str) -> dict:
    sets = [arg for value in ("metrics.serviceMonitor.enabled=true", *values) for arg in ("--set", value)]
    out = subprocess.run(
        [binary("helm"), "template", "kvpilot", str(CHART), "--namespace", OPERATOR_NAMESPACE, *sets],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    monitor = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    return endpoint


def scrape_config(job: str, target: str, endpoint: dict, override_honor_labels: bool = False) -> dict:
    """The scrape config the Prometheus Operator generates for one ServiceMonitor endpoint."""
    relabels = []
    for rule in endpoint.get("metricRelabelings", []):
        assert set(rule) <= set(RELABEL_KEYS), rule
        relabels.append({RELABEL_KEYS[k]: (v.lower() if k == "action" else v) for k, v in rule.items()})
    return {
        "job_name": job,
        "scrape_interval": "1s",
        "honor_labels": bool(endpoint.get("honorLabels", False)) and not override_honor_labels,
        "metric_relabel_configs": relabels,
        "static_configs": [
            {
                "targets": [target],
                # what the operator's service discovery relabeling puts on the target
                "labels": {
                    "namespace": OPERATOR_NAMESPACE,
                    "service": "kvpilot",
                    "pod": "kvpilot-5d8f7c9b4-x2k9p",
                    "endpoint": "metrics",
                },
            }
        ],
    }


@pytest.fixture(scope="module")
def operator_metrics():
    metrics.record_status("ml", "smol", desired=3, spare=1, serving=2, ready=2, phase="Degraded")
    metrics.RECONCILIATIONS.labels("applied").inc()
    server, thread = start_http_server(0, addr="127.0.0.1", registry=metrics.REGISTRY)
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(5)
    metrics.forget("ml", "smol")


def query(base: str, expr: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory, operator_metrics):
    tmp_path = tmp_path_factory.mktemp("prometheus")
    default = service_monitor_endpoint()
    assert default["honorLabels"] is True
    jobs = {
        "chart": scrape_config("chart", operator_metrics, default),
        "chart-override-honor-labels": scrape_config(
            "chart-override-honor-labels", operator_metrics, default, override_honor_labels=True
        ),
        "chart-honor-labels-off": scrape_config(
            "chart-honor-labels-off",
            operator_metrics,
            service_monitor_endpoint("metrics.serviceMonitor.honorLabels=false"),
        ),
        "no-handling": scrape_config("no-handling", operator_metrics, {"port": "metrics"}),
    }
    config = tmp_path / "prometheus.yml"
    config.write_text(
        yaml.safe_dump({"global": {"scrape_interval": "1s"}, "scrape_configs": list(jobs.values())})
    )
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            binary("prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            try:
                scraped = {
                    r["metric"]["job"]
                    for r in query(base, "kvpilot_operator_inferenceservice_desired_replicas")
                }
            except OSError:
                scraped = set()
            if scraped == set(jobs):
                break
            assert time.monotonic() < deadline, f"scraped so far: {scraped}"
            time.sleep(0.5)
        yield base
    finally:
        process.terminate()
        process.wait(10)
        log.close()


def test_operator_series_keep_the_inference_services_namespace(prometheus):
    series = {
        r["metric"]["job"]: r["metric"]
        for r in query(prometheus, "kvpilot_operator_inferenceservice_desired_replicas")
    }
    for job in ("chart", "chart-override-honor-labels", "chart-honor-labels-off"):
        assert series[job]["namespace"] == "ml", (job, series[job])
        assert "exported_namespace" not in series[job]
        assert series[job]["inferenceservice"] == "smol"
        assert series[job]["pod"] == "kvpilot-5d8f7c9b4-x2k9p"  # the target's other labels stay
    # what the issue saw: Prometheus moved the series' namespace away
    assert series["no-handling"]["namespace"] == OPERATOR_NAMESPACE
    assert series["no-handling"]["exported_namespace"] == "ml"
    # a series without a namespace of its own keeps the target's
    reconciliations = query(prometheus, 'kvpilot_operator_reconciliations_total{job="chart"}')
    assert {r["metric"]["namespace"] for r in reconciliations} == {OPERATOR_NAMESPACE}


def test_dashboard_panel_and_replica_alert_find_the_series(prometheus):
    dashboard = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    panel = next(p for p in dashboard["panels"] if p["title"].startswith("Replicas: desired vs ready"))
    desired, ready = (t["expr"] for t in panel["targets"][:2])

    def for_job(expr: str, job: str) -> str:
        return re.sub(r'\{namespace=~"\$namespace"\}', f'{{namespace=~"ml", job="{job}"}}', expr)

    for job in ("chart", "chart-override-honor-labels"):
        assert [r["value"][1] for r in query(prometheus, for_job(desired, job))] == ["3"]
        assert [r["value"][1] for r in query(prometheus, for_job(ready, job))] == ["2"]
    assert query(prometheus, for_job(desired, "no-handling")) == []  # the empty panel of the issue

    rules = yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())
    alert = next(
        r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "KvpilotReplicasNotReady"
    )
    firing = {r["metric"]["job"]: r["metric"] for r in query(prometheus, alert["expr"])}
    assert firing["chart"]["namespace"] == "ml" and firing["chart"]["inferenceservice"] == "smol"
    assert (
        firing["no-handling"]["namespace"] == OPERATOR_NAMESPACE
    )  # the alert would name the wrong namespace
