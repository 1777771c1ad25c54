"""Security: with API keys, the tenant comes from the key, not from the client's ``x-tenant`` header.

A key bound to a tenant (``--api-key KEY:TENANT``) owns that tenant's prefix cache and rate bucket; another
key claiming it with ``x-tenant`` (or claiming the key-derived ``key:<hex>`` id a span shows) gets neither,
and a fresh ``x-tenant`` per request does not escape its own rate limit. The router sidecar, proven by the
deployment's token, may still name the tenant. Without API keys (no identities) the header is believed.
"""

from __future__ import annotations

import pytest
from live_server import ServerProcess

from kvpilot.engine.server.cli import build_parser, server_config_from_namespace
from kvpilot.engine.server.config import ServerConfigError
from kvpilot.engine.tenancy import TenantError, TenantPolicy, key_tenant, parse_api_key, resolve_tenant

ALICE, BOB, CAROL = "sk-alice-0123456789", "sk-bob-0123456789", "sk-carol-0123456789"
TOKEN = "router-token-0123456789abcdef"
PROMPT = "The quick brown fox jumps over the lazy dog " * 6  # several full 16-token blocks
OTHER_PROMPT = "A key value cache keeps the keys and values of every token " * 5


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("tenant-identity") / "server.log"
    server = ServerProcess(
        [
            "--model",
            "tiny-random",
            "--num-kv-blocks",
            "256",
            "--warmup-buckets",
            "none",
            "--api-key",
            f"{ALICE}:alice",
            "--api-key",
            BOB,
            "--api-key",
            CAROL,
            "--router-token",
            TOKEN,
            "--tenant-rate-limit",
            "0.01",
            "--tenant-burst",
            "4",
        ],
        log,
    ).wait_ready()
    yield server
    server.stop()


def complete(server: ServerProcess, key: str, headers: dict[str, str] | None = None, prompt: str = PROMPT):
    import httpx

    r = httpx.post(
        server.url + "/v1/completions",
        timeout=60,
        json={"model": "tiny-random", "prompt": prompt, "max_tokens": 1},
        headers={"Authorization": f"Bearer {key}", **(headers or {})},
    )
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] if r.status_code == 200 else None
    return r.status_code, cached


def test_security_a_key_cannot_claim_another_tenants_cache_or_rate_bucket(keyed_server):
    assert complete(keyed_server, ALICE) == (200, 0)  # alice 1: caches the prompt
    status, cached = complete(keyed_server, ALICE)  # alice 2: her own cache
    assert status == 200 and cached >= 32
    assert complete(keyed_server, BOB, {"x-tenant": "alice"}) == (200, 0)  # bob 1: not alice's cache
    # carol's key is unbound: her tenant is the key's digest, which spans show; claiming it gets nothing
    assert complete(keyed_server, CAROL, prompt=OTHER_PROMPT) == (200, 0)
    assert complete(keyed_server, BOB, {"x-tenant": key_tenant(CAROL)}, OTHER_PROMPT) == (200, 0)  # bob 2
    # a fresh x-tenant per request stays in bob's own bucket (burst 4): the fifth is refused
    assert complete(keyed_server, BOB, {"x-tenant": "fresh-1"})[0] == 200  # bob 3
    assert complete(keyed_server, BOB, {"x-tenant": "fresh-2"})[0] == 200  # bob 4
    assert complete(keyed_server, BOB, {"x-tenant": "fresh-3"})[0] == 429
    # bob's claims drained nothing of alice's bucket: she still has her third and fourth request
    assert complete(keyed_server, ALICE)[0] == 200
    # the router sidecar (its token) may name the tenant: this request is alice's (her 4th token)
    status, cached = complete(keyed_server, BOB, {"x-tenant": "alice", "x-kvpilot-router-token": TOKEN})
    assert status == 200 and cached >= 32
    assert complete(keyed_server, ALICE)[0] == 429  # and it was charged to alice's bucket


def test_security_a_wrong_router_token_is_not_trusted():
    policy = TenantPolicy(authenticated=True, router_token=TOKEN)
    headers = {"authorization": f"Bearer {BOB}", "x-tenant": "alice"}
    assert resolve_tenant({**headers, "x-kvpilot-router-token": TOKEN[:-1] + "x"}, policy) == key_tenant(BOB)
    assert resolve_tenant({**headers, "x-kvpilot-router-token": TOKEN}, policy) == "alice"
    assert resolve_tenant(headers, TenantPolicy(authenticated=True, router_token=None)) == key_tenant(BOB)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (TenantPolicy(), "claimed"),  # no API keys: no identities to protect
        (TenantPolicy(authenticated=True), "bound"),
        (TenantPolicy(authenticated=True, trust_header=True), "claimed"),  # behind a proxy that sets it
    ],
)
def test_which_source_names_the_tenant(policy, expected):
    policy = TenantPolicy(
        authenticated=policy.authenticated, trust_header=policy.trust_header, key_tenants={"k": "bound"}
    )
    assert resolve_tenant({"authorization": "Bearer k", "x-tenant": "claimed"}, policy) == expected
    assert resolve_tenant({"authorization": "Bearer k"}, policy) == "bound"
    assert resolve_tenant({}, policy) is None


def test_key_bindings_and_keys_files_parse_with_clear_errors(tmp_path):
    assert parse_api_key("sk-1") == ("sk-1", None)
    assert parse_api_key("sk-1:team-a") == ("sk-1", "team-a")
    with pytest.raises(TenantError, match="malformed binding"):
        parse_api_key("sk-1:")
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nsk-a:alpha\n\nsk-b\n")
    config = server_config_from_namespace(
        build_parser().parse_args(["--api-keys-file", str(keys), "--api-key", "sk-c:gamma"])
    )
    assert config.api_keys == ("sk-c", "sk-a", "sk-b")
    assert dict(config.api_key_tenants) == {"sk-c": "gamma", "sk-a": "alpha"}
    assert "sk-a" not in repr(config)  # keys never appear in logs of the config
    with pytest.raises(ServerConfigError, match=r"--api-keys-file .*: No such file"):
        server_config_from_namespace(build_parser().parse_args(["--api-keys-file", str(tmp_path / "nope")]))
    with pytest.raises(ServerConfigError, match="--router-token must be at least 16"):
        server_config_from_namespace(build_parser().parse_args(["--router-token", "short"]))
