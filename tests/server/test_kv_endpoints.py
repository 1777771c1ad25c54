"""``/load``, ``/kv/events`` and ``/kv/snapshot`` per docs/engine-router-contract.md: field names and types,
ordered gap-free events whose hashes are the router's own (salted per tenant), snapshot = replayed events,
one epoch everywhere, ``gap`` for a reader in the future or one whose events were dropped, a new epoch
for a new engine."""

from __future__ import annotations

import httpx
import pytest

from kvpilot.engine.kv.block_hash import block_hashes, encode_extra_keys
from kvpilot.engine.kv.events import KVEventLog
from kvpilot.router.engine_load import EngineLoad

LOAD_FIELDS = {
    "model": str,
    "epoch": str,
    "ready": bool,
    "phase": str,
    "waiting": int,
    "running": int,
    "swapped": int,
    "queued_prefill_tokens": int,
    "running_decode_tokens": int,
    "kv_blocks_total": int,
    "kv_blocks_free": int,
    "kv_blocks_cached": int,
    "kv_blocks_reserved": int,
    "kv_usage": float,
    "block_size": int,
    "max_model_len": int,
    "kv_cache_bytes": int,
    "kv_cache_sizing": str,
    "kv_cache_dtype": str,
    "quantization": str,
    "dtype": str,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "prefill_tokens_per_second": float,
    "decode_step_seconds": float,
}


@pytest.mark.e2e
def test_load_has_every_contract_field_and_the_router_accepts_it(tiny_server):
    load = tiny_server.get("/load").json()
    assert {k: type(load[k]) for k in LOAD_FIELDS} == LOAD_FIELDS
    assert (load["model"], load["ready"], load["phase"], load["block_size"], load["kv_blocks_total"]) == (
        "tiny-random",
        True,
        "ready",
        16,
        511,
    )
    assert EngineLoad.from_json(load).ready


@pytest.mark.e2e
def test_events_are_ordered_salted_like_the_routers_and_match_the_snapshot(tiny_server, router_headers):
    start = tiny_server.get("/kv/events?since=0").json()
    epoch, root, seq0 = start["epoch"], bytes.fromhex(start["root"]), start["seq"]
    prompt = [3 + (i * 5) % 400 for i in range(40)]  # two full blocks
    tiny_server.post(
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 1},
        headers={"x-tenant": "kv-test", **router_headers},
    )
    batch = tiny_server.get(f"/kv/events?since={seq0}").json()
    assert (batch["epoch"], batch["gap"], batch["block_size"]) == (epoch, False, 16)
    assert batch["root"] == start["root"]
    seqs = [e["seq"] for e in batch["events"]]
    assert seqs == list(range(seq0 + 1, batch["seq"] + 1))
    stored = [h for e in batch["events"] if e["type"] == "stored" for h in e["block_hashes"]]
    expected = [h.hex() for h in block_hashes(prompt, 16, root, encode_extra_keys(cache_salt="kv-test"))]
    assert stored[:2] == expected
    snapshot = tiny_server.get("/kv/snapshot").json()
    assert (snapshot["epoch"], snapshot["block_size"], snapshot["root"]) == (epoch, 16, start["root"])
    assert snapshot["seq"] >= batch["seq"] and set(expected) <= set(snapshot["block_hashes"])
    # replaying every event from 0 gives exactly the snapshot's set
    replay: set[str] = set()
    for event in tiny_server.get("/kv/events?since=0").json()["events"]:
        if event["type"] == "stored":
            replay |= set(event["block_hashes"])
        elif event["type"] == "removed":
            replay -= set(event["block_hashes"])
        else:
            replay.clear()
    assert replay == set(snapshot["block_hashes"])
    assert tiny_server.get("/load").json()["epoch"] == epoch


@pytest.mark.e2e
def test_a_reader_from_the_future_sees_a_gap_and_since_is_validated(tiny_server):
    now = tiny_server.get("/kv/events?since=0").json()["seq"]
    assert tiny_server.get(f"/kv/events?since={now}").json() | {"root": None, "epoch": None} == {
        "epoch": None,
        "seq": now,
        "gap": False,
        "block_size": 16,
        "root": None,
        "events": [],
    }
    future = tiny_server.get(f"/kv/events?since={now + 5}").json()
    assert (future["gap"], future["events"]) == (True, [])
    assert tiny_server.get("/kv/events?since=-1").status_code == 400


def test_dropped_events_are_a_gap_and_a_new_engine_a_new_epoch(start_in_process):
    def engine_with_a_short_log():
        from kvpilot.engine.engine_args import EngineArgs
        from kvpilot.engine.engine_core import LLMEngine

        engine = LLMEngine(EngineArgs(model="tiny-random", num_kv_blocks=64).create_config())
        engine.kv_events = engine.pool.events = KVEventLog(capacity=4)
        return engine

    first = start_in_process({"num_kv_blocks": 64}, engine_factory=engine_with_a_short_log)
    httpx.post(first.url + "/v1/completions", json={"prompt": list(range(3, 100)), "max_tokens": 1})
    full = httpx.get(first.url + "/kv/events?since=0").json()
    assert full["seq"] > 4 and (full["gap"], full["events"]) == (True, [])
    recent = httpx.get(first.url + f"/kv/events?since={full['seq'] - 4}").json()
    assert not recent["gap"]
    assert [e["seq"] for e in recent["events"]] == list(range(full["seq"] - 3, full["seq"] + 1))
    second = start_in_process({"num_kv_blocks": 64})
    other = httpx.get(second.url + "/kv/events?since=0").json()
    assert other["epoch"] != full["epoch"] and other["root"] == full["root"]  # same model, same hash root
