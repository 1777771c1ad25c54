"""``kvpilot router``: flag validation with one-line errors, weights parsing, and the real process end to end
(SIGTERM included); the router's modules never import torch."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import aiohttp
import pytest

from kvpilot.router.cli import build_parser, config_from_args, main
from kvpilot.router.config import ConfigError, ScoringWeights
from kvpilot.router.proxy import REPLICA_HEADER

KVPILOT = os.path.join(os.path.dirname(sys.executable), "kvpilot")


def test_help_lists_the_contract_flags(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in (
        "--port",
        "--replicas",
        "--endpointslices",
        "--namespace",
        "--model",
        "--policy",
        "--weights",
        "--poll-interval",
        "--request-timeout",
    ):
        assert flag in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--replicas", "ftp://x:1"], "replica URL must look like http://host:port"),
        (["--replicas", "http://a:1/v1"], "without a path"),
        (["--replicas", "http://a:1,http://a:1"], "lists a URL twice"),
        (["--replicas", " , "], "needs at least one URL"),
        (
            ["--replicas", "http://a:1", "--weights", "speed=2"],
            "unknown weight 'speed'; known: queue, prefill",
        ),
        (["--replicas", "http://a:1", "--weights", "queue"], "entries are key=value"),
        (["--replicas", "http://a:1", "--weights", "queue=-1"], "weight queue must be a finite number >= 0"),
        (["--replicas", "http://a:1", "--weights", "decode=x"], "weight decode must be a number"),
        (["--replicas", "http://a:1", "--poll-interval", "0"], "--poll-interval must be a positive number"),
        (["--replicas", "http://a:1", "--port", "70000"], "--port must be 0..65535"),
        (["--replicas", "http://a:1", "--model", "/no/such/model"], "cannot resolve model '/no/such/model'"),
        (["--endpointslices", "svc-engines"], "--endpointslices needs --namespace"),
        (
            ["--replicas", "http://a:1", "--stream-buffer-bytes", "1000"],
            "--stream-buffer-bytes must be >= 16384",
        ),
        (["--replicas", "http://a:1", "--write-stall-timeout", "-1"], "--write-stall-timeout must be >= 0"),
        (
            ["--replicas", "http://a:1", "--router-token", "short"],
            "--router-token must be at least 16 characters (the operator provisions 64)",
        ),
        (["--replicas", "http://[::1"], "replica URL 'http://[::1': Invalid IPv6 URL"),
    ],
)
def test_invalid_flags_end_in_one_line_and_status_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpilot router: error: ") and message in err and "Traceback" not in err


def test_argparse_errors_return_2(capsys):
    assert main([]) == 2  # neither --replicas nor --endpointslices
    assert main(["--replicas", "http://a:1", "--policy", "random"]) == 2
    assert "invalid choice: 'random'" in capsys.readouterr().err


def test_weights_parse_into_the_typed_config():
    assert ScoringWeights.parse("queue=2, decode=0.5,,tie_ms=0") == ScoringWeights(
        queue=2.0, decode=0.5, tie_ms=0.0
    )
    assert ScoringWeights.parse("") == ScoringWeights()
    with pytest.raises(ConfigError, match="given twice"):
        ScoringWeights.parse("queue=1,queue=2")
    with pytest.raises(ConfigError, match="finite"):
        ScoringWeights.parse("balance=inf")


def test_the_prefill_rate_is_the_fleets_unless_per_replica_rates_are_asked_for():
    fleet = config_from_args(build_parser().parse_args(["--replicas", "http://a:1"]))
    mixed = config_from_args(
        build_parser().parse_args(["--replicas", "http://a:1", "--per-replica-prefill-rate"])
    )
    assert (fleet.per_replica_prefill_rate, mixed.per_replica_prefill_rate) == (False, True)


def test_the_engines_keys_make_the_router_predict_tenants_from_keys(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# the engines' keys\nkey-a:alpha\n\nkey-c\n")
    parse = build_parser().parse_args
    config = config_from_args(
        parse(["--replicas", "http://a:1", "--api-keys-file", str(keys), "--api-key", "k:b"])
    )
    policy = config.tenant_policy()
    assert (policy.authenticated, dict(policy.key_tenants)) == (True, {"key-a": "alpha", "k": "b"})
    assert not config_from_args(parse(["--replicas", "http://a:1"])).tenant_policy().authenticated
    with pytest.raises(ConfigError, match="api-keys-file"):
        config_from_args(parse(["--replicas", "http://a:1", "--api-keys-file", str(tmp_path / "missing")]))
    with pytest.raises(ConfigError, match="malformed binding"):
        config_from_args(parse(["--replicas", "http://a:1", "--api-key", "key:" + "\x01"]))


def test_router_modules_do_not_import_torch():
    code = (
        "import sys, kvpilot.router.cli, kvpilot.router.app, kvpilot.router.server,"
        " kvpilot.router.endpointslices;"
        "from kvpilot.router.server import load_profiler;"
        "assert 'torch' not in sys.modules, 'torch imported';"
        "assert 'kubernetes' not in sys.modules, 'kubernetes imported for a static fleet'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.e2e
async def test_the_router_process_serves_and_stops_on_sigterm(fake_engines, tiny_model_dir, unused_tcp_port):
    engines = await fake_engines(2)
    process = await asyncio.create_subprocess_exec(
        KVPILOT,
        "router",
        "--host",
        "127.0.0.1",
        "--port",
        str(unused_tcp_port),
        "--replicas",
        ",".join(e.url for e in engines),
        "--model",
        str(tiny_model_dir),
        "--poll-interval",
        "0.05",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{unused_tcp_port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            for _ in range(300):
                try:
                    async with http.get(base + "/ready") as response:
                        if response.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("router never became ready")
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
            async with http.post(base + "/v1/chat/completions", json=body) as response:
                assert response.status == 200 and response.headers[REPLICA_HEADER] in {e.url for e in engines}
                assert (await response.read()).endswith(b"data: [DONE]\n\n")
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 10) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
