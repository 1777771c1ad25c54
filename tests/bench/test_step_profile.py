"""``bench/step_profile.py``: the busy-fraction arithmetic, and a short CPU run that reports every stage."""

from __future__ import annotations

import json

import pytest
from bench_scripts import bench_script

step_profile = bench_script("step_profile")


@pytest.mark.parametrize(
    ("intervals", "wall", "expected"),
    [
        ([], 10.0, 0.0),
        ([(0, 2), (1, 3), (5, 6)], 10.0, 0.4),  # overlap counted once
        ([(4, 5), (0, 10), (2, 3)], 10.0, 1.0),  # nested and unsorted
        ([(0, 1)], 0.0, 0.0),
    ],
)
def test_busy_fraction_is_the_union_of_intervals(intervals, wall, expected):
    assert step_profile.busy_fraction(intervals, wall) == pytest.approx(expected)


def test_short_cpu_run_times_every_stage_of_decode_steps(tmp_path, tiny_model_dir):
    out = tmp_path / "profile.json"
    assert (
        step_profile.main(
            ["--batch", "6", "--prompt-len", "5", "--steps", "4", "--warmup", "1", "--output-json", str(out)]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert (result["device"], result["batch"], result["steps"], result["sampling"]) == ("cpu", 6, 4, True)
    assert set(result["stage_ms_p50"]) == {*step_profile.STAGES, "other"}
    assert all(ms >= 0 for ms in result["stage_ms_p50"].values())
    assert result["stage_ms_p50"]["forward"] > 0 and result["stage_ms_p50"]["sample"] > 0
    assert result["output_tokens_per_second"] == pytest.approx(6 / (result["step_ms_p50"] / 1e3))
    assert "gpu_busy_fraction" not in result


def test_bad_sizes_are_refused(capsys):
    with pytest.raises(SystemExit):
        step_profile.main(["--batch", "0"])
    assert "--batch, --prompt-len and --steps must be >= 1" in capsys.readouterr().err


def test_ab_rounds_time_the_c_decode_step_on_and_off(tmp_path, tiny_model_dir):
    out = tmp_path / "ab.json"
    argv = ["--batch", "3", "--prompt-len", "5", "--steps", "2", "--warmup", "1", "--cpu-time"]
    assert step_profile.main([*argv, "--ab-native-decode", "1", "--output-json", str(out)]) == 0
    ab = json.loads(out.read_text())["native_decode_ab_ms"]
    assert set(ab) == {"on", "off"} and min(ab.values()) > 0


def test_ab_rounds_time_asynchronous_scheduling_on_and_off(tmp_path, tiny_model_dir):
    out = tmp_path / "ab.json"
    argv = ["--batch", "3", "--prompt-len", "5", "--steps", "2", "--warmup", "1", "--async-scheduling"]
    assert step_profile.main([*argv, "--ab-async-scheduling", "1", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    ab = result["async_scheduling_ab_ms"]
    assert set(ab) == {"on", "off"} and min(ab.values()) > 0
    # the appends of each step's in-flight tokens are timed as the deferred stage
    assert result["stage_ms_p50"]["deferred"] > 0
