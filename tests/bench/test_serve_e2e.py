"""``kvpilot bench serve`` end to end against the fake OpenAI-compatible server of conftest.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvpilot.bench.arrivals import arrival_offsets
from kvpilot.bench.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_open_loop_sweep_writes_report_and_plots(fake_server, tmp_path, capsys):
    server = fake_server(token_delay_s=0.002, fail_every=7, ready_after_s=0.4)
    report_path, plot_dir = tmp_path / "out" / "report.json", tmp_path / "plots"
    code = main(
        [
            "serve",
            "--base-url",
            server.url,
            "--wait-ready",
            "--request-rate",
            "40,80",
            "--num-requests",
            "12",
            "--warmup-requests",
            "2",
            "--input-len",
            "8:16",
            "--output-len",
            "4:6",
            "--slo-ttft",
            "1",
            "--slo-tpot",
            "0.5",
            "--seed",
            "1",
            "--output-json",
            str(report_path),
            "--plot-dir",
            str(plot_dir),
            "--no-progress",
        ]
    )
    assert code == 0
    report = json.loads(report_path.read_text())

    assert report["model"] == "fake-model"  # discovered from /v1/models
    assert server.ready_polls[0] == 503 and server.ready_polls[-1] == 200
    assert report["cold_start"]["ready"]["polls"] == len(server.ready_polls)
    assert [r["phase"] for r in report["cold_start"]["warmup_records"]] == ["warmup", "warmup"]
    assert [p["load"] for p in report["points"]] == [40.0, 80.0]
    # Requests 1-2 are warm-up; the server fails numbers 7, 14 (point 1) and 21 (point 2).
    assert [p["summary"]["errors"] for p in report["points"]] == [{"http_500": 2}, {"http_500": 1}]
    assert [p["summary"]["requests_ok"] for p in report["points"]] == [10, 11]
    assert [p["summary"]["slo"]["total"] for p in report["points"]] == [12, 12]
    assert len(server.requests) == 2 + 12 + 12

    first, second = (p["records"] for p in report["points"])
    # Each point (and the warm-up) gets fresh prompts, so no point is served from another's prefix cache.
    prompts = [body["prompt"] for _, body in server.requests]
    assert not set(prompts[:2]) & set(prompts[2:14]) and not set(prompts[2:14]) & set(prompts[14:])
    # The arrival pattern is the same at both rates, rescaled (80 req/s: half the gaps of 40 req/s).
    assert [r["scheduled_s"] / 2 for r in first] == pytest.approx(
        [r["scheduled_s"] for r in second], rel=1e-12
    )
    for record in first + second:
        assert record["phase"] == "measured" and 4 <= record["max_tokens"] <= 6
        if not record["ok"]:
            assert record["error_type"] == "http_500" and record["ttft_s"] is None
            continue
        assert (record["output_tokens"], record["output_token_source"]) == (record["max_tokens"], "usage")
        assert (record["prompt_tokens"], record["prompt_token_source"]) == (record["prompt_words"], "usage")
        assert len(record["emit_s"]) == record["max_tokens"]
        assert record["ttft_s"] == pytest.approx(record["emit_s"][0] - record["scheduled_s"], abs=2e-6)
        assert record["e2e_s"] >= record["ttft_s"] > 0
        assert record["sent_s"] >= record["scheduled_s"]
    summary = report["points"][0]["summary"]
    assert summary["output_token_source"] == "server usage (10/10)"
    assert summary["itl_s"]["count"] == sum(len(r["emit_s"]) - 1 for r in first if r["ok"])
    assert report["saturation"]["rule"]["latency"] == "ttft_p50"
    assert report["points"][0]["client_overhead"]["loop_lag_samples"] > 0
    assert "goodput" in report["definitions"]

    assert report["plots"] == [str(plot_dir / "throughput_vs_latency.png"), str(plot_dir / "latency_cdf.png")]
    for name in ("throughput_vs_latency.png", "latency_cdf.png"):
        data = (plot_dir / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000

    out = capsys.readouterr().out
    for expected in (
        "== open loop, rate 40 req/s (Poisson) ==",
        "== open loop, rate 80 req/s (Poisson) ==",
        "== cold start",
        "== sweep (open loop",
        "saturation  ",
        "errors      http_500: 2",
        "throughput  request ",
        "SLO         TTFT<=1000 ms, TPOT<=500 ms: attainment 83.3% (10/12)",
    ):
        assert expected in out


def test_closed_loop_chat_shared_prefix_without_usage_classifies_errors(fake_server, tmp_path):
    # Requests 3, 6, 9 lose their connection mid-stream; 5 and 10 hang (5 s) past the 2 s timeout, which
    # leaves a loaded CI host room: with 0.5 s an ordinary request once timed out too.
    server = fake_server(token_delay_s=0.001, break_every=3, hang_every=5, hang_s=5.0)
    report_path = tmp_path / "report.json"
    code = main(
        [
            "serve",
            "--base-url",
            server.url,
            "--api",
            "chat",
            "--model",
            "explicit-model",
            "--workload",
            "shared-prefix",
            "--num-tenants",
            "2",
            "--system-prompt-len",
            "20",
            "--input-len",
            "3:5",
            "--output-len",
            "3",
            "--concurrency",
            "2",
            "--num-requests",
            "10",
            "--warmup-requests",
            "0",
            "--no-usage",
            "--request-timeout",
            "2",
            "--api-key",
            "s3cret",
            "--output-json",
            str(report_path),
            "--no-progress",
        ]
    )
    assert code == 0
    report = json.loads(report_path.read_text())
    (point,) = report["points"]
    assert (point["mode"], point["load"], report["saturation"]) == ("closed", 2.0, None)
    assert point["summary"]["errors"] == {"stream_broken": 3, "timeout": 2}
    ok = [r for r in point["records"] if r["ok"]]
    assert len(ok) == 5
    # The role-only first event is no token; without usage, tokens are counted from chunks.
    assert all((r["output_tokens"], r["output_token_source"]) == (3, "chunks") for r in ok)
    assert point["summary"]["prompt_token_source"] == "word-count estimate (5/5)"
    assert report["config"]["endpoint"]["api_key"] == "<redacted>"
    assert "s3cret" not in report_path.read_text()
    system_prompts = {}
    for headers, body in server.requests:
        assert headers["Authorization"] == "Bearer s3cret"
        assert body["model"] == "explicit-model" and "stream_options" not in body
        assert headers["x-tenant"] == body["user"] in ("tenant-0", "tenant-1")
        system, user = body["messages"]
        assert system["role"] == "system" and system["content"].startswith(body["user"] + ": ")
        assert system_prompts.setdefault(body["user"], system["content"]) == system["content"]
        assert user["role"] == "user"
    assert len(set(system_prompts.values())) == len(system_prompts)


def test_sharegpt_file_with_a_duration_bound(fake_server, tmp_path):
    server = fake_server(token_delay_s=0.001)
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(
        json.dumps(
            [
                {
                    "conversations": [
                        {"from": "human", "value": "say hi"},
                        {"from": "gpt", "value": "hi there you"},
                    ]
                },
                {
                    "conversations": [
                        {"from": "human", "value": "count to nine"},
                        {"from": "gpt", "value": "one two three four five six seven eight nine"},
                    ]
                },
            ]
        )
    )
    report_path = tmp_path / "report.json"
    code = main(
        [
            "serve",
            "--base-url",
            server.url,
            "--workload",
            "sharegpt",
            "--dataset-path",
            str(dataset),
            "--sharegpt-output-cap",
            "6",
            "--request-rate",
            "20",
            "--duration",
            "0.4",
            "--seed",
            "5",
            "--warmup-requests",
            "0",
            "--output-json",
            str(report_path),
            "--no-progress",
        ]
    )
    assert code == 0
    records = json.loads(report_path.read_text())["points"][0]["records"]
    arrival_seed = np.random.SeedSequence(5).spawn(3)[0]
    expected = arrival_offsets(20.0, 1.0, np.random.default_rng(arrival_seed), duration_s=0.4)
    assert [r["scheduled_s"] for r in records] == expected.tolist()
    assert all(r["ok"] for r in records)
    assert {r["max_tokens"] for r in records} <= {3, 6}  # answer words, 9 capped at 6
    assert {body["prompt"] for _, body in server.requests} <= {"say hi", "count to nine"}
