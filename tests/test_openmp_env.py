"""``import kvpilot`` chooses how idle OpenMP workers wait (before torch loads), unless the user already
did."""

import json
import os
import subprocess
import sys

import pytest

KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def env_after_import(**preset: str) -> dict[str, str | None]:
    env = {k: v for k, v in os.environ.items() if k not in KEYS}
    env.update(preset)
    code = f"import json, os, kvpilot; print(json.dumps({{k: os.environ.get(k) for k in {KEYS!r}}}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_default_is_a_short_spin_then_sleep() -> None:
    assert env_after_import() == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "20000"}


@pytest.mark.parametrize(
    "preset",
    [
        {"OMP_WAIT_POLICY": "ACTIVE"},
        {"OMP_WAIT_POLICY": "PASSIVE"},
        {"GOMP_SPINCOUNT": "0"},
        {"GOMP_SPINCOUNT": "infinite"},
    ],
)
def test_a_users_setting_wins_and_nothing_is_added(preset: dict[str, str]) -> None:
    assert env_after_import(**preset) == {key: preset.get(key) for key in KEYS}
