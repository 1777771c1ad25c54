"""`kvpilot operator render` and `crd`: exact output, and invalid input named without a traceback."""

from __future__ import annotations

import io
import math

import pytest
import yaml

from kvpilot.operator.cli import build_parser, main
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.crd import crd_yaml
from kvpilot.operator.leader import LeaseSettings

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


def _no_kopf(monkeypatch):
    """`run` stops before Kopf starts: what these tests check is refused by then, or not at all."""
    monkeypatch.setattr("kvpilot.operator.cli._run", lambda args: 0)


@pytest.mark.parametrize(
    ("liveness", "metrics_port"),
    [("http://0.0.0.0:8081/healthz", "8081"), ("http://127.0.0.1/healthz", "80")],  # Kopf's default: 80
)
def test_run_refuses_a_metrics_port_that_is_the_liveness_port(liveness, metrics_port, capsys, monkeypatch):
    _no_kopf(monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        main(["run", "-A", f"--liveness={liveness}", "--metrics-port", metrics_port])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(
        f"kvpilot operator run: error: --metrics-port {metrics_port} is the port of --liveness {liveness}: "
        "the operator cannot listen on both; pick another port for one of them\n"
    )


def test_run_accepts_distinct_metrics_and_liveness_ports(monkeypatch):
    _no_kopf(monkeypatch)
    assert main(["run", "-A", "--liveness=http://0.0.0.0:8081/healthz", "--metrics-port", "8082"]) == 0


@pytest.mark.parametrize(
    ("liveness", "detail"),
    [
        ("notaurl", ""),
        ("0.0.0.0:8080/healthz", ""),
        ("https://0.0.0.0:8080/healthz", ""),  # Kopf serves http only
        ("http://0.0.0.0:8080", ""),  # no path
        ("http:///healthz", ""),  # no host
        ("http://0.0.0.0:99999/healthz", " (Port out of range 0-65535)"),
        ("http://0.0.0.0:0/healthz", " (port 0)"),
        ("http://0.0.0.0:port/healthz", " (Port could not be cast to integer value as 'port')"),
        ("http://[::1/healthz", " (Invalid IPv6 URL)"),
        ("http://0.0.0.0:8080/healthz?x=1", " (Kopf would ignore its query, fragment or user)"),
    ],
)
def test_run_refuses_a_liveness_url_kopf_cannot_serve(liveness, detail, capsys, monkeypatch):
    _no_kopf(monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        main(["run", "-A", f"--liveness={liveness}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith(
        "kvpilot operator run: error: argument --liveness: expected an http://HOST:PORT/PATH URL like "
        f"http://0.0.0.0:8080/healthz, got {liveness!r}{detail}\n"
    )
    assert "Traceback" not in err


@pytest.mark.parametrize("flag", ["status_interval_seconds", "resync_interval_seconds"])
@pytest.mark.parametrize("seconds", [math.nan, math.inf])
def test_operator_intervals_must_be_finite(flag, seconds):
    with pytest.raises(ValueError, match="must be positive"):
        OperatorConfig(**{flag: seconds})


def test_lease_timings_must_be_finite():
    with pytest.raises(ValueError, match="leader election needs 0 < --lease-retry-period"):
        LeaseSettings(namespace="ns", identity="me", duration_s=math.inf)


def test_render_of_a_binary_file_is_a_message(tmp_path):
    binary = tmp_path / "isvc.yaml"
    binary.write_bytes(b"\x00\xff\xfe")
    err = io.StringIO()
    assert main(["render", "-f", str(binary)], out=io.StringIO(), err=err) == 2
    assert err.getvalue() == (
        f"error: cannot read {binary}: 'utf-8' codec can't decode byte 0xff in position 1: "
        "invalid start byte\n"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["render", "-f", "-", "-n", "Team_A"],
            "kvpilot operator render: error: argument -n/--namespace: expected a DNS label "
            "(lowercase a-z, 0-9 and '-'), got 'Team_A'",
        ),
        (
            ["render", "-f", "-", "--engine-image", ""],
            "kvpilot operator render: error: argument --engine-image: expected an image reference like "
            "ghcr.io/org/kvpilot:1.0, got ''",
        ),
        (
            ["run", "-A", "--engine-image", "kvpilot latest"],
            "kvpilot operator run: error: argument --engine-image: expected an image reference like "
            "ghcr.io/org/kvpilot:1.0, got 'kvpilot latest'",
        ),
        (
            ["run", "-A", "--leader-elect", "--lease-namespace", "NS"],
            "kvpilot operator run: error: argument --lease-namespace: expected a DNS label "
            "(lowercase a-z, 0-9 and '-'), got 'NS'",
        ),
    ],
)
def test_render_and_run_refuse_a_bad_namespace_or_image(argv, message, capsys, monkeypatch):
    _no_kopf(monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        main(argv, out=io.StringIO(), stdin=io.StringIO(ISVC))
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(message + "\n")


def test_an_empty_pod_namespace_is_no_lease_namespace(monkeypatch):
    # argparse checks a string default with the flag's type even when the flag is not given: an empty
    # $POD_NAMESPACE made 'run -A' (no leader election) exit 2 naming --lease-namespace
    monkeypatch.setenv("POD_NAMESPACE", "")
    args = build_parser().parse_args(["run", "-A", "--standalone"])
    assert args.lease_namespace is None
    monkeypatch.setenv("POD_NAMESPACE", "team-a")
    assert build_parser().parse_args(["run", "-A", "--leader-elect"]).lease_namespace == "team-a"
