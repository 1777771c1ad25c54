"""A bounded schemathesis run against the server's own ``/openapi.json``: whatever bodies and parameters it
generates for every operation, the server never answers 5xx. The model's context is cut to 64 tokens so
the generated requests stay cheap."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from kvpilot.engine.server.config import ServerConfig, WarmupBucket

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def fuzzed_server(start_in_process):
    config = ServerConfig(warmup_buckets=(WarmupBucket(1, 8),), queue_timeout_s=20.0)
    return start_in_process(
        {"max_model_len": 64, "num_kv_blocks": 128, "max_num_seqs": 16, "max_num_batched_tokens": 256}, config
    )


_GET_AND_HEAD = ("/v1/models", "/health", "/ready", "/load", "/metrics")
EXPECTED_OPERATIONS = {
    "POST /v1/completions",
    "POST /v1/chat/completions",
    *(f"{method} {path}" for path in _GET_AND_HEAD for method in ("GET", "HEAD")),
    "GET /kv/events",
    "GET /kv/snapshot",
}


def test_no_server_errors(fuzzed_server):
    # schemathesis' own pytest plugin does not run under this pytest version; its strategies do
    schema = schemathesis.openapi.from_url(fuzzed_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} == EXPECTED_OPERATIONS
    for op in operations:
        examples = 25 if op.method.upper() == "POST" else 5
        has_input = len(op.body) > 0 or len(op.query) > 0  # nothing to break in an operation without input
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if has_input else [])
        for mode in modes:

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(
                max_examples=examples,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            def no_5xx(case) -> None:
                response = case.call(base_url=fuzzed_server.url, timeout=60)
                case.validate_response(response, checks=[not_a_server_error])

            no_5xx()
