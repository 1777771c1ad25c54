"""Bad flags exit 2 with an argparse message; an unusable endpoint exits 1 with one line, no traceback."""

from __future__ import annotations

import pytest

from kvpilot import cli as kvpilot_cli
from kvpilot.bench.cli import main

UNUSED = "http://127.0.0.1:18731"  # nothing listens: a case the flags do not stop fails to connect


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--request-rate", "-1"], "--request-rate values must be > 0 or inf (got -1.0)"),
        (["--request-rate", "abc"], "expected rates like '4' or '1,2,4,inf', got 'abc'"),
        (["--concurrency", "0"], "--concurrency values must be >= 1 (got 0)"),
        (["--concurrency", "2,2"], "--concurrency lists a level twice"),
        (["--request-rate", "1,2,1"], "--request-rate lists a rate twice"),
        (["--ready-url", "localhost/ready"], "--ready-url must start with http://"),
        (["--concurrency", "2", "--request-rate", "3"], "not allowed with argument"),
        (["--concurrency", "2", "--max-concurrency", "3"], "--max-concurrency caps open-loop load"),
        (["--request-rate", "inf", "--duration", "5"], "needs --num-requests"),
        (["--input-len", "5:2"], "--input-len needs 1 <= MIN <= MAX (got 5:2)"),
        (["--output-len", "x"], "expected N or MIN:MAX, got 'x'"),
        (["--workload", "sharegpt"], "--workload sharegpt needs --dataset-path"),
        (["--slo-ttft", "0"], "--slo-ttft must be a positive number of seconds (got 0.0)"),
        (["--burstiness", "0"], "--burstiness must be a positive finite number"),
        (["--base-url", "localhost:8000"], "--base-url must start with http:// or https://"),
        (["--api", "grpc"], "invalid choice: 'grpc'"),
        (["--saturation-latency-factor", "1"], "--saturation-latency-factor must be > 1"),
        (
            ["--base-url", "http://[::1"],
            "--base-url is not a valid URL: Invalid IPv6 URL (got 'http://[::1')",
        ),
        (
            ["--base-url", "http://127.0.0.1:99999"],
            "--base-url is not a valid URL: Port out of range 0-65535 (got 'http://127.0.0.1:99999')",
        ),
        (["--base-url", "http://"], "--base-url has no host (got 'http://')"),
        (  # was polled until --ready-timeout
            ["--ready-url", "http://[::1/ready", "--ready-timeout", "1", "--base-url", UNUSED],
            "--ready-url is not a valid URL: Invalid IPv6 URL (got 'http://[::1/ready')",
        ),
        (["--temperature", "nan", "--base-url", UNUSED], "--temperature must be >= 0 (got nan)"),
    ],
)
def test_bad_flags_exit_2_with_a_message_naming_the_flag(flags, message, capsys):
    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert "kvpilot bench serve: error:" in err and message in err


def test_unusable_dataset_exits_2(tmp_path, capsys):
    dataset = tmp_path / "empty.json"
    dataset.write_text("[]")
    assert main(["serve", "--workload", "sharegpt", "--dataset-path", str(dataset), "--no-progress"]) == 2
    assert "no entry has a 'conversations' list" in capsys.readouterr().err


def test_unreachable_endpoint_exits_1_without_a_traceback(closed_port, capsys):
    url = f"http://127.0.0.1:{closed_port}"
    assert main(["serve", "--base-url", url, "--num-requests", "1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"kvpilot bench serve: error: cannot reach the endpoint at {url}" in err
    assert "Traceback" not in err


def test_endpoint_that_never_gets_ready_exits_1(fake_server, capsys):
    server = fake_server(ready_after_s=60.0)
    code = main(
        ["serve", "--base-url", server.url, "--wait-ready", "--ready-timeout", "0.3", "--no-progress"]
    )
    assert code == 1
    err = capsys.readouterr().err
    assert f"{server.url}/ready was not ready after 0.3 s" in err and "last: HTTP 503" in err


def test_help_and_dispatch_through_the_kvpilot_command(capsys):
    assert kvpilot_cli.main(["bench", "serve", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--request-rate" in out and "--slo-ttft" in out and "--plot-dir" in out
    assert main([]) == 2  # a subcommand is required
    assert "the following arguments are required: SUBCOMMAND" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "name", "message"),
    [
        (
            "--output-json",
            "taken/report.json",
            "--output-json {tmp}/taken/report.json: {tmp}/taken is not a writable directory",
        ),
        ("--output-json", "dir", "--output-json {tmp}/dir is a directory"),
        ("--plot-dir", "taken", "--plot-dir {tmp}/taken is not a directory"),
        (
            "--plot-dir",
            "taken/plots",
            "--plot-dir {tmp}/taken/plots: {tmp}/taken is not a writable directory",
        ),
    ],
)
def test_an_output_path_that_cannot_be_written_exits_2_before_the_run(flag, name, message, tmp_path, capsys):
    (tmp_path / "taken").write_text("a file")
    (tmp_path / "dir").mkdir()
    assert main(["serve", "--base-url", UNUSED, flag, f"{tmp_path}/{name}"]) == 2
    assert capsys.readouterr().err.endswith(f"kvpilot bench serve: error: {message.format(tmp=tmp_path)}\n")


def test_a_report_that_fails_to_write_after_the_run_exits_1_in_one_line(
    fake_server, tmp_path, monkeypatch, capsys
):
    def full_disk(path, report):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("kvpilot.bench.serve_cli.write_report", full_disk)
    server = fake_server()
    flags = [
        "--num-requests",
        "1",
        "--warmup-requests",
        "0",
        "--no-progress",
        "--output-json",
        str(tmp_path / "r.json"),
    ]
    assert main(["serve", "--base-url", server.url, *flags]) == 1
    err = capsys.readouterr().err
    assert err.endswith(
        "kvpilot bench serve: error: cannot write the results: [Errno 28] No space left on device\n"
    )
    assert "Traceback" not in err


def test_an_existing_writable_report_file_is_taken_whatever_its_directory_allows(tmp_path, monkeypatch):
    """A non-root user's ``--output-json /dev/stdout`` or a report kept in a read-only directory: the file is
    opened for writing in place (write_report), so only its own permission counts. os.access is faked: the
    tests run as root, for whom every path is writable."""
    from kvpilot.bench import config

    locked, report = tmp_path / "locked", tmp_path / "locked" / "report.json"
    locked.mkdir()
    report.write_text("{}")
    writable = {report: True, locked: False}
    monkeypatch.setattr(config.os, "access", lambda path, mode: writable.get(config.Path(path), True))
    assert config.output_path_error("--output-json", report, directory=False) is None
    writable[report] = False
    assert config.output_path_error("--output-json", report, directory=False) == (
        f"--output-json {report} is not writable"
    )
    new = locked / "new.json"  # a new file needs its directory writable
    assert config.output_path_error("--output-json", new, directory=False) == (
        f"--output-json {new}: {locked} is not a writable directory"
    )
