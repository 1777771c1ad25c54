"""Speculative decoding through ``kvpilot serve --speculative-config``
(docs/architecture.md#speculative-decoding): greedy completions, streamed and not, equal the plain server's;
the ``kvpilot_spec_decode_*`` series count the drafts; a bad config is a CLI error, not a traceback."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from metrics_text import scrape

pytestmark = pytest.mark.e2e
MODEL = "tiny-random"
TINY_ARGS = ["--model", MODEL, "--num-kv-blocks", "512", "--warmup-buckets", "1x8"]


SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})


def repetitive_prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(8)] * 5


def test_speculative_server_matches_the_plain_one_and_counts_its_drafts(start_process, client):
    server = start_process([*TINY_ARGS, "--speculative-config", SPEC])
    spec_client = server.client()
    before = scrape(server)
    for seed in range(3):
        prompt = repetitive_prompt(seed)
        kw = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 30,
            "temperature": 0,
            "extra_body": {"ignore_eos": True},
        }
        want = client.completions.create(**kw).choices[0].text
        got = spec_client.completions.create(**kw).choices[0].text
        streamed = "".join(c.choices[0].text for c in spec_client.completions.create(**kw, stream=True))
        assert got == want
        assert streamed == want
    after = scrape(server)
    m = f'model_name="{MODEL}"'

    def grew(name: str) -> float:
        return after.get(f"{name}{{{m}}}", 0.0) - before.get(f"{name}{{{m}}}", 0.0)

    drafts = grew("kvpilot_spec_decode_num_drafts_total")
    accepted = grew("kvpilot_spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= grew("kvpilot_spec_decode_num_draft_tokens_total")
    assert grew("kvpilot_spec_decode_acceptance_length_count") == drafts
    # every emitted token is one accepted draft or the one token after a verification
    assert grew("kvpilot_spec_decode_acceptance_length_sum") == drafts + accepted
    first = after.get(f'kvpilot_spec_decode_num_accepted_tokens_per_pos_total{{{m},position="0"}}', 0.0)
    assert 0 < first <= accepted


def test_a_bad_speculative_config_is_a_cli_error():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvpilot.cli",
            "serve",
            "--model",
            MODEL,
            "--speculative-config",
            '{"method": "x"}',
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert result.returncode == 2, result.stderr
    assert "speculative_config: method must be one of" in result.stderr
    assert "Traceback" not in result.stderr
