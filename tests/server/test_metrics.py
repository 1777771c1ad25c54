"""``/metrics``: promtool-clean, every name the Helm chart's dashboard and alerts use, and the latency
definitions of docs/architecture.md#latency-definitions (TTFT + ΣITL = t_last_emit − t_arrival ≤ E2E; TPOT =
ΣITL / (N − 1)), SLO counters, prefix-cache counters and their tenant isolation, measured as exact deltas
around single requests."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from metrics_text import scrape

pytestmark = pytest.mark.e2e
MODEL = "tiny-random"
CHART = Path(__file__).resolve().parents[2] / "charts" / "kvpilot"


def delta(before: dict, after: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


M = f'model_name="{MODEL}"'


def test_promtool_check_metrics_is_clean(tiny_server, client):
    client.completions.create(model=MODEL, prompt="warm the histograms", max_tokens=3)
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: run scripts/setup.sh (Debian's prometheus package)"
    text = tiny_server.get("/metrics").text
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_every_engine_metric_the_chart_uses_is_exposed(tiny_server, client):
    client.completions.create(model=MODEL, prompt="chart", max_tokens=2)
    used = set()
    for path in (CHART / "files" / "grafana-dashboard.json", CHART / "files" / "prometheus-rules.yaml"):
        used |= set(re.findall(r"kvpilot_[a-z0-9_]+", path.read_text()))
    others = ("kvpilot_operator_", "kvpilot_router_", "kvpilot_activator_")  # checked by their own tests
    engine_names = {n for n in used if not n.startswith(others)}
    exposed = {key.split("{")[0] for key in scrape(tiny_server)}
    assert engine_names == {
        "kvpilot_slo_attained_requests_total",
        "kvpilot_requests_finished_total",
        "kvpilot_kv_cache_usage_ratio",
        "kvpilot_num_requests_waiting",
        "kvpilot_num_requests_running",
        "kvpilot_prefix_cache_hits_total",
        "kvpilot_prefix_cache_queries_total",
        "kvpilot_time_to_first_token_seconds_bucket",
        "kvpilot_time_per_output_token_seconds_bucket",
        "kvpilot_inter_token_latency_seconds_bucket",
        "kvpilot_e2e_request_latency_seconds_bucket",
        "kvpilot_startup_phase_seconds_sum",
        "kvpilot_startup_phase_seconds_count",
        "kvpilot_num_preemptions_total",
        "kvpilot_requests_rejected_total",
        "kvpilot_spec_decode_num_accepted_tokens_total",
        "kvpilot_spec_decode_num_draft_tokens_total",
        "kvpilot_spec_decode_acceptance_length_sum",
        "kvpilot_spec_decode_acceptance_length_count",
    }
    assert engine_names <= exposed, engine_names - exposed


def test_latency_definitions_hold_exactly_for_one_streamed_request(tiny_server, client):
    before = scrape(tiny_server)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The cat sat on the mat",
            max_tokens=6,
            stream=True,
            temperature=0.0,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    prompt_tokens = chunks[-1].usage.prompt_tokens
    after = scrape(tiny_server)

    def d(name: str, labels: str = M) -> float:
        return delta(before, after, f"{name}{{{labels}}}")

    assert d("kvpilot_time_to_first_token_seconds_count") == 1
    assert d("kvpilot_inter_token_latency_seconds_count") == 5  # N - 1
    assert d("kvpilot_time_per_output_token_seconds_count") == 1
    assert d("kvpilot_e2e_request_latency_seconds_count") == 1
    ttft, itl = d("kvpilot_time_to_first_token_seconds_sum"), d("kvpilot_inter_token_latency_seconds_sum")
    tpot, e2e = d("kvpilot_time_per_output_token_seconds_sum"), d("kvpilot_e2e_request_latency_seconds_sum")
    assert ttft > 0 and ttft + itl <= e2e
    assert tpot == pytest.approx(itl / 5, rel=1e-9, abs=1e-12)
    assert d("kvpilot_requests_finished_total", f'finished_reason="length",{M}') == 1
    assert d("kvpilot_slo_attained_requests_total") == 1  # 60 s objectives: met
    assert d("kvpilot_slo_attained_generation_tokens_total") == 6
    assert d("kvpilot_generation_tokens_total") == 6
    assert d("kvpilot_prompt_tokens_total") == prompt_tokens  # nothing of it was cached
    assert d("kvpilot_request_queue_time_seconds_count") == 1
    assert d("kvpilot_request_prefill_time_seconds_count") == 1
    assert d("kvpilot_request_decode_time_seconds_count") == 1
    assert d("kvpilot_request_generation_tokens_sum") == 6
    assert d("kvpilot_request_prompt_tokens_sum") == prompt_tokens


def test_prefix_cache_counts_hits_and_never_crosses_tenants(tiny_server, router_headers):
    prompt = [11 + (i % 97) for i in range(70)]  # 4 full blocks; at most (70 - 1) // 16 = 4 can hit
    body = {"prompt": prompt, "max_tokens": 1}

    def run(tenant: str) -> tuple[int, float, float]:
        before = scrape(tiny_server)
        out = tiny_server.post("/v1/completions", body, headers={"x-tenant": tenant, **router_headers}).json()
        after = scrape(tiny_server)
        return (
            out["usage"]["prompt_tokens_details"]["cached_tokens"],
            delta(before, after, f"kvpilot_prefix_cache_queries_total{{{M}}}"),
            delta(before, after, f"kvpilot_prefix_cache_hits_total{{{M}}}"),
        )

    assert run("tenant-a") == (0, 70, 0)
    assert run("tenant-b") == (0, 70, 0)  # same tokens, other tenant: salted hashes, no hit
    assert run("tenant-a") == (64, 70, 64)


def test_gauges_follow_the_load_snapshot(tiny_server):
    load = tiny_server.get("/load").json()
    samples = scrape(tiny_server)
    assert samples[f'kvpilot_kv_cache_blocks{{{M},state="total"}}'] == load["kv_blocks_total"] == 511
    assert (
        samples[
            f'kvpilot_cache_config_info{{block_size="16",cache_dtype="auto",kv_cache_sizing="num_kv_blocks",'
            f'{M},num_gpu_blocks="511"}}'
        ]
        == 1
    )
    assert samples[f'kvpilot_server_phase{{{M},phase="ready"}}'] == 1
    assert (load["quantization"], load["dtype"]) == ("none", "float32")  # a float checkpoint on CPU
    assert samples[f'kvpilot_model_config_info{{dtype="float32",{M},quantization="none"}}'] == 1
    assert samples[f'kvpilot_slo_objective_seconds{{{M},objective="ttft"}}'] == 60
