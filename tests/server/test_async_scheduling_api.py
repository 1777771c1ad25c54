"""``kvpilot serve --async-scheduling`` (docs/architecture.md#asynchronous-scheduling): streamed
completions, parallel samples, stop strings and logprobs come out of the OpenAI API as they do without it,
and the engine counts the same output tokens (a stop found a step late computes a row, not a token)."""

from __future__ import annotations

import httpx

from kvpilot.engine.server.config import ServerConfig, WarmupBucket

CONFIG = ServerConfig(warmup_buckets=(WarmupBucket(1, 8),))


def _answers(server) -> list:
    client = server.client()
    model = client.models.list().data[0].id
    stream = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True
    )
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    samples = client.completions.create(
        model=model, prompt="hello there", max_tokens=10, temperature=0.9, seed=4, n=2
    )
    stopped = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=12, temperature=0, stop=[streamed[4:7]]
    )
    scored = client.completions.create(model=model, prompt="x y z", max_tokens=5, temperature=0, logprobs=2)
    return [
        streamed,
        sorted((c.index, c.text, c.finish_reason) for c in samples.choices),
        (stopped.choices[0].text, stopped.choices[0].finish_reason),
        (scored.choices[0].text, [round(v, 4) for v in scored.choices[0].logprobs.token_logprobs]),
    ]


def test_async_scheduling_serves_the_same_answers(start_in_process):
    sync = start_in_process({"num_kv_blocks": 64}, CONFIG)
    asynchronous = start_in_process({"num_kv_blocks": 64, "async_scheduling": True}, CONFIG)
    want, got = _answers(sync), _answers(asynchronous)
    assert got == want
    assert want[2][1] == "stop" and len(want[0]) > 7  # the stop string did end the request
    assert _generation_tokens(asynchronous) == _generation_tokens(sync) > 0


def _generation_tokens(server) -> float:
    lines = httpx.get(server.url + "/metrics", timeout=10).text.splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("kvpilot_generation_tokens_total")
    )
