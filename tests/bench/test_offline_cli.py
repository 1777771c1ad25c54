"""``kvpilot bench offline`` end to end on the tiny model, and the random-prompt id range it draws from."""

import json

import pytest

from kvpilot.bench.offline_cli import make_workload, token_id_range
from kvpilot.cli import main


@pytest.mark.parametrize("vocab_size, expected", [(49152, (100, 40000)), (512, (100, 512)), (300, (75, 300))])
def test_token_id_range_fits_the_vocabulary(vocab_size, expected):
    assert token_id_range(vocab_size) == expected


def test_bench_offline_runs_a_model_with_a_small_vocabulary(tiny_model_dir, tmp_path, capsys):
    """The tiny model's vocabulary is 512: prompts drawn from SmolLM2's id range would be rejected."""
    report = tmp_path / "offline.json"
    code = main(
        [
            "bench",
            "offline",
            "--model",
            str(tiny_model_dir),
            "--num-requests",
            "3",
            "--input-len",
            "4:9",
            "--output-len",
            "2:5",
            "--warmup",
            "0",
            "--output-json",
            str(report),
        ]
    )
    assert code == 0, capsys.readouterr().err
    summary = json.loads(report.read_text())
    workload = make_workload(3, (4, 9), (2, 5), seed=0, vocab=token_id_range(512))
    assert all(100 <= token < 512 for prompt in workload.prompts for token in prompt)
    assert summary["prompt_tokens"] == workload.num_prompt_tokens
    # ignore_eos + max_tokens: exactly the drawn output lengths
    assert summary["output_tokens"] == workload.num_output_tokens
    assert "3 requests" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--input-len", "8:x", "expected N or MIN:MAX"),
        ("--output-len", "9:3", "--output-len needs 1 <= MIN <= MAX (got 9:3)"),
    ],
)
def test_bench_offline_rejects_bad_ranges_with_a_usage_error(flag, value, message, capsys):
    assert main(["bench", "offline", "--model", "tiny-random", flag, value]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--shared-prefix-len", "-5"], "--shared-prefix-len must be >= 0 (got -5)"),
        (["--warmup", "-1"], "--warmup must be >= 0 (got -1)"),
        (["--output-json", "{tmp}"], "--output-json {tmp} is a directory"),
        (
            ["--output-json", "{tmp}/taken/x.json"],
            "--output-json {tmp}/taken/x.json: {tmp}/taken is not a writable directory",
        ),
    ],
)
def test_bench_offline_refuses_bad_flags_before_loading_the_model(flags, message, tmp_path, capsys):
    (tmp_path / "taken").write_text("a file")
    flags = [flag.format(tmp=tmp_path) for flag in flags]
    assert main(["bench", "offline", "--model", "tiny-random", "--num-requests", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert err.endswith(f"kvpilot bench offline: error: {message.format(tmp=tmp_path)}\n")


def test_bench_offline_prompts_past_the_context_exit_1_in_one_line(tiny_model_dir, capsys):
    flags = ["--num-requests", "1", "--input-len", "600", "--output-len", "1", "--warmup", "0"]
    assert main(["bench", "offline", "--model", str(tiny_model_dir), *flags]) == 1
    err = capsys.readouterr().err
    assert err.endswith(
        "kvpilot bench offline: prompt has 600 tokens; the context limit is 512 (prompt + at least one "
        "generated token)\n"
    )
    assert "Traceback" not in err
