"""`kvpilot operator render` and `crd`: exact output, and invalid input named without a traceback."""

from __future__ import annotations

import io

import yaml

from kvpilot.operator.cli import main
from kvpilot.operator.crd import crd_yaml

ISVC = """apiVersion: kvpilot.dev/v1alpha1
kind: InferenceService
metadata: {name: smol}
spec:
  model: {source: smollm2-135m}
  scaling: {targetRequestsPerSecond: 10, perReplicaGoodput: 4}
"""


def test_render_prints_the_children_in_apply_order():
    out, err = io.StringIO(), io.StringIO()
    assert main(["render", "-f", "-", "-n", "ml"], out=out, err=err, stdin=io.StringIO(ISVC)) == 0
    documents = list(yaml.safe_load_all(out.getvalue()))
    assert [(d["kind"], d["metadata"]["name"]) for d in documents] == [
        ("ServiceAccount", "smol-router"),
        ("Role", "smol-router"),
        ("RoleBinding", "smol-router"),
        ("Secret", "smol-router-token"),
        ("Service", "smol-engines"),
        ("Service", "smol"),
        ("PodDisruptionBudget", "smol"),
        ("Deployment", "smol"),
    ]
    assert documents[-1]["spec"]["replicas"] == 4
    assert all(
        d["metadata"]["namespace"] == "ml" and "ownerReferences" not in d["metadata"] for d in documents
    )
    assert err.getvalue() == "# ml/smol: clamp(ceil(10 × (1 + 0.2) / 4) + 1, 1, 100) = 4\n"


def test_render_refuses_an_invalid_spec_naming_the_field():
    out, err = io.StringIO(), io.StringIO()
    bad = ISVC.replace("perReplicaGoodput: 4", "perReplicaGoodput: 0")
    assert main(["render", "-f", "-"], out=out, err=err, stdin=io.StringIO(bad)) == 2
    assert out.getvalue() == ""
    assert err.getvalue().startswith(
        "error: - (document 1): spec.scaling.perReplicaGoodput: Invalid value: 0:"
    )
    assert "Traceback" not in err.getvalue()


def test_render_of_a_missing_file_is_a_message():
    err = io.StringIO()
    assert main(["render", "-f", "/nonexistent/isvc.yaml"], out=io.StringIO(), err=err) == 2
    assert err.getvalue().startswith("error: cannot read /nonexistent/isvc.yaml:")


def test_crd_prints_the_generated_definition():
    out = io.StringIO()
    assert main(["crd"], out=out) == 0
    assert out.getvalue() == crd_yaml()


def test_run_refuses_a_cluster_domain_that_is_no_dns_domain(capsys, monkeypatch):
    monkeypatch.setenv("CLUSTER_DOMAIN", "Corp_Example")  # the default comes from the environment
    # bad lease timings too: were the domain not checked, the run would still stop (with their message)
    lease = ["--leader-elect", "--lease-namespace=ns", "--lease-duration=1", "--lease-renew-deadline=2"]
    assert main(["run", "--all-namespaces", *lease]) == 2
    assert capsys.readouterr().err == (
        "kvpilot operator run: --cluster-domain must be a DNS domain like cluster.local, got 'Corp_Example'\n"
    )
