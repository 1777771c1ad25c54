"""``bench serve`` against a served context smaller than its lengths: measured, fitted, failures loud.

A kvpilot tiny-random server (max_model_len 512, 3.1 tokens a word) refused 255 of 256 requests of the
default lengths (128:512 words, 32:128 max_tokens) with HTTP 400, and the bench printed the throughput of
the one that fitted and exited 0. The fake server of conftest.py stands in for it: it reports its context
in /v1/models, costs 3 tokens a word plus 1, and refuses what does not fit as vLLM does.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from kvpilot.bench.cli import main
from kvpilot.bench.config import EndpointConfig, WorkloadConfig
from kvpilot.bench.context_fit import (
    ASSUMED_RATE,
    TokenRate,
    fit_workload,
    longest_request_tokens,
    measure_token_rate,
)
from kvpilot.bench.endpoint import EndpointError, resolve_model
from kvpilot.bench.sse_client import OpenAIStreamClient

TINY_CONTEXT = {"max_model_len": 256, "tokens_per_word": 3, "bos_tokens": 1, "token_delay_s": 0.0}


def _serve(server, tmp_path, *extra: str) -> int:
    return main(
        [
            "serve",
            "--base-url",
            server.url,
            "--num-requests",
            "16",
            "--seed",
            "3",
            "--output-json",
            str(tmp_path / "report.json"),
            "--no-progress",
            *extra,
        ]
    )


def test_default_lengths_are_fitted_to_the_served_context(fake_server, tmp_path, capsys):
    server = fake_server(**TINY_CONTEXT)
    assert _serve(server, tmp_path) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    summary = report["points"][0]["summary"]
    assert (summary["requests_ok"], summary["errors"]) == (16, {})
    fit = report["context_fit"]
    assert fit["max_model_len"] == 256
    assert fit["rate"] == {"per_word": 3.0, "overhead": 1.0, "measured": True}
    assert fit["workload"]["input_len_range"] == [15, 63] and fit["workload"]["output_len_range"] == [3, 15]
    # every load request (the probes ask for one token, unstreamed) fits the server's context
    sent = [body for _, body in server.requests if body["stream"]]
    assert len(sent) == 2 + 16
    assert max(server.prompt_tokens(body) + body["max_tokens"] for body in sent) <= 256
    assert "--input-len 15:63 --output-len 3:15" in capsys.readouterr().out


def test_refused_requests_are_shown_and_fail_the_run(fake_server, tmp_path, capsys):
    server = fake_server(**TINY_CONTEXT)
    code = _serve(
        server,
        tmp_path,
        "--no-context-fit",
        "--input-len",
        "40:120",
        "--output-len",
        "8",
        "--warmup-requests",
        "0",
    )
    out, err = capsys.readouterr()
    report = json.loads((tmp_path / "report.json").read_text())
    summary = report["points"][0]["summary"]
    assert code == 3
    assert report["context_fit"] is None
    # 1 + 3 x words + 8 <= 256 holds up to 82 words
    refused = [r for r in report["points"][0]["records"] if r["prompt_words"] > 82]
    assert summary["errors"] == {"http_400": len(refused)} and len(refused) > 0
    assert f"FAILED      {len(refused)} of 16 requests failed" in out
    assert "first http_400: " in out and "maximum context length is 256 tokens" in out
    assert "requests were refused as invalid, the first with http_400" in err


def test_a_run_whose_warmup_all_fails_stops_before_the_load(fake_server, tmp_path, capsys):
    server = fake_server(**TINY_CONTEXT)
    code = _serve(server, tmp_path, "--no-context-fit", "--input-len", "100", "--output-len", "8")
    err = capsys.readouterr().err
    assert code == 1
    assert "all 2 warm-up requests failed, the first with http_400" in err
    assert "maximum context length is 256 tokens" in err
    assert len(server.requests) == 2  # no load point was sent
    assert not (tmp_path / "report.json").exists()


def test_server_failures_mark_the_figures_without_failing_the_run(fake_server, tmp_path, capsys):
    server = fake_server(fail_every=4, token_delay_s=0.0)
    code = _serve(server, tmp_path, "--input-len", "4:8", "--output-len", "2:4", "--warmup-requests", "0")
    out = capsys.readouterr().out
    assert code == 0  # a 5xx is the server's answer under this load, part of the measurement
    assert "FAILED      4 of 16 requests failed (see errors below)" in out
    assert (
        'errors      http_500: 4\n            first http_500: {"error": {"message": "injected failure"}}'
        in out
    )


def test_fit_scales_every_length_by_the_largest_factor_that_fits():
    rate = TokenRate(per_word=3.0, overhead=1.0, measured=True)
    assert longest_request_tokens(WorkloadConfig(), rate) == 1801  # 1 + 3 x (512 + 2 sqrt 512) + 128
    fit = fit_workload(WorkloadConfig(), rate, 512)
    assert (fit.workload.input_len_range, fit.workload.output_len_range) == ((33, 135), (8, 33))
    assert longest_request_tokens(fit.workload, rate) == 509
    shared = WorkloadConfig(kind="shared-prefix", system_prompt_len=1024)
    fitted = fit_workload(shared, rate, 512).workload
    assert (fitted.system_prompt_len, fitted.input_len_range, fitted.output_len_range) == (
        94,
        (11, 47),
        (2, 11),
    )


def test_fit_keeps_lengths_that_fit_and_refuses_a_context_nothing_fits():
    small = WorkloadConfig(input_len_range=(10, 20), output_len_range=(4, 8))
    fit = fit_workload(small, TokenRate(per_word=3.0, overhead=1.0, measured=True), 512)
    assert (fit.scale, fit.workload) == (1.0, small)
    with pytest.raises(EndpointError, match="cannot hold even a one-word prompt"):
        fit_workload(small, TokenRate(per_word=3.0, overhead=10.0, measured=True), 12)


def _measure(server) -> TokenRate:
    async def measure() -> TokenRate:
        async with aiohttp.ClientSession() as session:
            served = await resolve_model(session, server.url, None, 5.0)
            assert served.max_model_len == server.behavior.max_model_len
            return await measure_token_rate(
                OpenAIStreamClient(session, EndpointConfig(server.url), served.id)
            )

    return asyncio.run(measure())


def test_token_rate_is_measured_exactly_on_the_endpoint(fake_server):
    assert _measure(fake_server(max_model_len=512, tokens_per_word=3, bos_tokens=2)) == TokenRate(
        3.0, 2.0, True
    )
    assert _measure(fake_server(max_model_len=512, report_usage=False)) == ASSUMED_RATE


def test_named_model_takes_its_context_from_the_listing(fake_server):
    server = fake_server(max_model_len=300)

    async def resolve(model: str) -> int | None:
        async with aiohttp.ClientSession() as session:
            return (await resolve_model(session, server.url, model, 5.0)).max_model_len

    assert asyncio.run(resolve("fake-model")) == 300
    assert asyncio.run(resolve("another-model")) is None


def test_a_failing_probe_stops_the_run_with_the_answer(fake_server, tmp_path, capsys):
    server = fake_server(max_model_len=512, fail_every=1)
    assert _serve(server, tmp_path) == 1
    err = capsys.readouterr().err
    assert "prompt-length probe (max_tokens 1, unstreamed) failed: HTTP 500: " in err
    assert "injected failure" in err and "--no-context-fit skips the probes" in err
    assert len(server.requests) == 1
