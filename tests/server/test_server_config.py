"""``kvpilot serve`` flags and ``ServerConfig`` validation: bad values exit 2 with a message naming the
flag, before anything is loaded; warm-up buckets parse and clip to the engine."""

from __future__ import annotations

import pytest

from kvpilot import cli as kvpilot_cli
from kvpilot.engine.server.cli import build_parser, server_config_from_namespace
from kvpilot.engine.server.config import ServerConfig, ServerConfigError, WarmupBucket, parse_warmup_buckets
from kvpilot.engine.server.warmup import effective_buckets


def test_warmup_buckets_parse_and_clip():
    assert parse_warmup_buckets("1x16, 8X64") == (WarmupBucket(1, 16), WarmupBucket(8, 64))
    assert parse_warmup_buckets("none") == parse_warmup_buckets("") == ()
    with pytest.raises(ServerConfigError, match="'8x' is not BATCHxTOKENS"):
        parse_warmup_buckets("1x16,8x")
    clipped = effective_buckets(
        (WarmupBucket(1, 16), WarmupBucket(128, 4096), WarmupBucket(1, 16)),
        max_model_len=512,
        max_num_seqs=64,
        max_num_batched_tokens=256,
        chunked_prefill=False,
    )
    assert clipped == [WarmupBucket(1, 16), WarmupBucket(64, 256)]


def test_flags_map_onto_the_config(monkeypatch):
    monkeypatch.setenv("KVPILOT_API_KEY", "from-env")
    ns = build_parser().parse_args(
        [
            "--slo-ttft",
            "0.5",
            "--tenant-rate-limit",
            "4",
            "--warmup-buckets",
            "2x32",
            "--timeout-keep-alive",
            "30",
        ]
    )
    config = server_config_from_namespace(ns)
    assert (
        config.api_keys,
        config.slo_ttft_s,
        config.effective_tenant_burst,
        config.warmup_buckets,
        config.timeout_keep_alive_s,
    ) == (("from-env",), 0.5, 4.0, (WarmupBucket(2, 32),), 30.0)
    ns = build_parser().parse_args(["--api-key", "a", "--api-key", "b"])
    assert server_config_from_namespace(ns).api_keys == ("a", "b")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "70000"], "--port must be in [1, 65535]"),
        (["--max-queue-len", "0"], "--max-queue-len must be >= 1"),
        (["--queue-timeout", "-1"], "--queue-timeout must be >= 0"),
        (["--slo-tpot", "0"], "--slo-tpot must be > 0"),
        (["--tenant-burst", "0.5"], "--tenant-burst must be >= 1"),
        (["--stream-buffer-chunks", "1"], "--stream-buffer-chunks must be >= 2"),
        (["--stream-buffer-bytes", "1000"], "--stream-buffer-bytes must be >= 16384"),
        (["--write-stall-timeout", "nan"], "--write-stall-timeout must be >= 0"),
        (["--timeout-keep-alive", "0"], "--timeout-keep-alive must be > 0"),
        (["--warmup-buckets", "x"], "--warmup-buckets: 'x' is not BATCHxTOKENS"),
        (["--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        kvpilot_cli.main(["serve", *flags])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_help_lists_engine_and_server_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        kvpilot_cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    flags = (
        "--max-num-batched-tokens",
        "--served-model-name",
        "--api-key",
        "--max-queue-len",
        "--queue-timeout",
        "--max-body-bytes",
        "--slo-ttft",
        "--slo-tpot",
        "--tenant-rate-limit",
        "--drain-grace-seconds",
        "--timeout-keep-alive",
    )
    assert [flag for flag in flags if flag not in out] == []


def test_defaults_are_valid_and_resume_at_half_the_buffer():
    config = ServerConfig()
    assert (config.host, config.port, config.stream_resume_depth, config.effective_tenant_burst) == (
        "0.0.0.0",
        8000,
        8,
        1.0,
    )
