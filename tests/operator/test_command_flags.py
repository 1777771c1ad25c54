"""`kvpilot operator fetch-model` and `activator`: a bad flag is an argparse error (exit 2) naming it, a
runtime failure one line and exit 1; never a traceback."""

from __future__ import annotations

import socket

import pytest

from kvpilot.operator.cli import main

CLOSED = "http://127.0.0.1:18729/m.gguf"  # never fetched: each case is refused before any request
FETCH = ["fetch-model", "--dest", "/nonexistent/cache"]
SOURCES = "(http(s)://…/<file>.gguf, s3://<bucket>/<key>.gguf, hf://<org>/<name>[@<revision>][/<file>.gguf])"


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.splitlines()[-1]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--source", "hf://nonexistent", "--size-limit", "100"],
            f"argument --source: expected a fetched model source {SOURCES}, got 'hf://nonexistent'",
        ),
        (
            ["--source", "foo", "--size-limit", "100"],
            f"argument --source: expected a fetched model source {SOURCES}, got 'foo'",
        ),
        (
            ["--source", "http://[::1/m.gguf", "--size-limit", "100"],
            "argument --source: 'http://[::1/m.gguf': Invalid IPv6 URL",
        ),
        (
            ["--source", "http://127.0.0.1:99999/m.gguf", "--size-limit", "100"],
            "argument --source: 'http://127.0.0.1:99999/m.gguf': Port out of range 0-65535",
        ),
        (
            ["--source", CLOSED, "--size-limit", "-5"],
            "argument --size-limit: expected a positive integer, got -5",
        ),
        (
            ["--source", CLOSED, "--size-limit", "0"],
            "argument --size-limit: expected a positive integer, got 0",
        ),
        (
            ["--source", CLOSED, "--size-limit", "1", "--sha256", "zz"],
            "argument --sha256: expected 64 hexadecimal digits, got 'zz'",
        ),
        (
            ["--source", "s3://bucket/k.gguf", "--size-limit", "1", "--endpoint", "minio:9000"],
            "argument --endpoint: expected an http:// or https:// URL, got 'minio:9000'",
        ),
    ],
)
def test_fetch_model_refuses_bad_flags(flags, message, capsys):
    assert _refused([*FETCH, *flags], capsys) == f"kvpilot operator fetch-model: error: {message}"


ACTIVATOR = ["activator", "--namespace", "ml", "--name", "smol"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "99999"], "argument --port: expected a TCP port (1-65535), got 99999"),
        (["--port", "0"], "argument --port: expected a TCP port (1-65535), got 0"),
        (["--queue-size", "-1"], "argument --queue-size: expected a positive integer, got -1"),
        (
            ["--hold-timeout", "nan"],
            "argument --hold-timeout: expected a positive number of seconds, got 'nan'",
        ),
        (["--hold-timeout", "0"], "argument --hold-timeout: expected a positive number of seconds, got '0'"),
        (
            ["--namespace", "ML_Team"],
            "argument --namespace: expected a DNS label (lowercase a-z, 0-9 and '-'), got 'ML_Team'",
        ),
    ],
)
def test_activator_refuses_bad_flags(flags, message, capsys):
    assert _refused([*ACTIVATOR, *flags], capsys) == f"kvpilot operator activator: error: {message}"


def _kubeconfig_at(path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod
    # the client reads $KUBECONFIG once, when imported: its default location is what a load reads
    monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(path))


@pytest.fixture
def kubeconfig(tmp_path, monkeypatch):
    """A kubeconfig that loads (nothing connects to its server before a request comes)."""
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:18729'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    _kubeconfig_at(path, monkeypatch)


def test_activator_without_a_cluster_configuration_exits_1_in_one_line(tmp_path, monkeypatch, capsys):
    _kubeconfig_at(tmp_path / "none", monkeypatch)
    assert main(ACTIVATOR) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith("kvpilot operator activator: no Kubernetes configuration: ") and err.count("\n") == 1
    )


def test_activator_on_a_taken_port_exits_1_in_one_line(kubeconfig, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 18730))
        taken.listen()
        port = taken.getsockname()[1]
        assert main([*ACTIVATOR, "--host", "127.0.0.1", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kvpilot operator activator: cannot listen on 127.0.0.1:{port}: [Errno 98] ")
    assert err.count("\n") == 1


@pytest.mark.parametrize("election", [[], ["--leader-elect", "--lease-namespace=ns"]])
def test_run_without_a_cluster_configuration_exits_1_in_one_line(election, tmp_path, monkeypatch, capsys):
    _kubeconfig_at(tmp_path / "none", monkeypatch)
    monkeypatch.setattr("kopf.cli.main", lambda **kwargs: None)  # were it reached, Kopf would retry for ever
    assert main(["run", "-A", *election]) == 1
    err = capsys.readouterr().err
    assert err == (
        "kvpilot operator run: no Kubernetes configuration (in-cluster or kubeconfig): "
        "Invalid kube-config file. No configuration found.\n"
    )


def test_a_standby_whose_liveness_port_is_taken_exits_1_in_one_line(kubeconfig, monkeypatch, capsys):
    monkeypatch.setattr("kvpilot.operator.leader.campaign", lambda lock: None)  # were it reached: no API
    monkeypatch.setattr("kopf.cli.main", lambda **kwargs: None)
    # Kopf's log set-up would leave a handler on this test's captured stderr for every later test
    monkeypatch.setattr("kopf.configure", lambda **kwargs: None)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 18731))
        taken.listen()
        argv = [
            "run",
            "-A",
            "--leader-elect",
            "--lease-namespace=ns",
            "--liveness",
            "http://127.0.0.1:18731/h",
        ]
        assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "kvpilot operator run: cannot listen on 127.0.0.1:18731 for --liveness: [Errno 98] "
    )
    assert err.count("\n") == 1
