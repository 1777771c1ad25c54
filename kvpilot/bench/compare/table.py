"""The comparison's markdown report, rendered from its ``summary.json`` dict (pure: no I/O, no clock)."""

from __future__ import annotations

import math

from kvpilot.bench.compare.environment import environment_lines
from kvpilot.bench.compare.results import (
    GEMM_CEILING_OUTPUT_TPS,
    REFERENCE_OUTPUT_TPS,
    SERVERS,
    STATUS_OK,
    SYSTEM_TITLES,
    output_tps_by_level,
    thin_p99,
)

#: always shown in the throughput table (a column of dashes when not measured); llama.cpp when measured
CORE_SYSTEMS = ("hf", "vllm", "kvpilot")
FEW_OPEN_REQUESTS = 20  # below this, the drain of a rate's last requests dominates its achieved rate
THIN = "†"  # marks a p99 on fewer than P99_MIN_SAMPLES samples


def _ms(seconds: float | None) -> str:
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "—"
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def _num(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _header(columns: list[str]) -> list[str]:
    return [_row(columns), _row(["---"] * len(columns))]


def _closed_throughput_lines(summary: dict) -> list[str]:
    systems = summary["systems"]
    shown = [n for n in SYSTEM_TITLES if n in CORE_SYSTEMS or systems.get(n, {}).get("status") == STATUS_OK]
    measured = {name: output_tps_by_level(systems.get(name, {})) for name in shown}
    peer = "llamacpp" in measured  # llama.cpp measured: its ratio column too
    levels = sorted(set(summary["plan"]["concurrencies"]))
    lines = ["## Closed loop: output tokens/s by concurrency (HF: batch size)", ""]
    lines += _header(
        [
            "concurrency / batch",
            *(SYSTEM_TITLES[n] for n in measured),
            "kvpilot / vLLM",
            *(["kvpilot / llama.cpp"] if peer else []),
            "issue: HF",
            "issue: vLLM",
        ]
    )
    for level in levels:
        kv, vl = measured["kvpilot"].get(level), measured["vllm"].get(level)
        ratio = f"{kv / vl:.2f}×" if kv and vl else "—"
        lc = measured["llamacpp"].get(level) if peer else None
        lines.append(
            _row(
                [
                    str(level),
                    *(_num(measured[n].get(level)) for n in measured),
                    ratio,
                    *([f"{kv / lc:.2f}×" if kv and lc else "—"] if peer else []),
                    _num(REFERENCE_OUTPUT_TPS["hf"].get(level)),
                    _num(REFERENCE_OUTPUT_TPS["vllm"].get(level)),
                ]
            )
        )
    lines += [
        "",
        f"fp32 GEMM ceiling on this kind of machine: about {GEMM_CEILING_OUTPUT_TPS:.0f} output "
        "tok/s at large batch. A closed loop of c clients is the served analogue of batch c; HF "
        "runs one static batch (all prompts together, left-padded, no arrivals). Output tok/s "
        "here includes the cost of every prompt's prefill; the latency tables also give total "
        "(prompt + output) tok/s.",
    ]
    return lines


def _latency_row(name: str, load: str, figures: dict) -> list[str]:
    ttft, tpot = figures["ttft_s"], figures["tpot_s"]
    mark = THIN if thin_p99(figures) else ""
    errors = ", ".join(f"{k} {v}" for k, v in figures["errors"].items()) or "0"
    return [
        SYSTEM_TITLES[name],
        load,
        f"{figures['requests_ok']}/{figures['requests_total']}",
        _num(figures["request_rps"], 2),
        _num(figures["output_tps"]),
        _num(figures["total_tps"]),
        _ms(ttft["p50"]),
        _ms(ttft["p99"]) + mark,
        _ms(tpot["p50"]),
        _ms(tpot["p99"]) + mark,
        _ms(figures["e2e_s"]["p50"]),
        errors,
    ]


LATENCY_COLUMNS = [
    "req ok/all",
    "req/s",
    "output tok/s",
    "total tok/s",
    "TTFT p50",
    "TTFT p99",
    "TPOT p50",
    "TPOT p99",
    "E2E p50",
    "errors",
]


def _closed_latency_lines(summary: dict) -> list[str]:
    lines = ["## Closed loop: latency", ""]
    lines += _header(["system", "concurrency", *LATENCY_COLUMNS])
    for name in SERVERS:
        system = summary["systems"].get(name, {})
        if system.get("status") != STATUS_OK:
            continue
        for level, figures in sorted(system.get("closed", {}).items(), key=lambda kv: int(kv[0])):
            lines.append(_row(_latency_row(name, level, figures)))
    hf = summary["systems"].get("hf", {})
    if hf.get("status") == STATUS_OK:
        lines += [
            "",
            "HF generate (one static batch; no per-request stream, so no TTFT): "
            + "; ".join(
                f"batch {b['batch']}: {b['wall_s']:.1f} s for {b['output_tokens']} tokens, "
                f"{_ms(b['step_s'])} per decode step"
                for b in sorted(hf["batches"].values(), key=lambda b: b["batch"])
            ),
        ]
    return lines


def _open_loop_lines(summary: dict) -> list[str]:
    lines = ["## Open loop: Poisson arrivals, rate sweep", ""]
    lines += _header(["system", "offered req/s", *LATENCY_COLUMNS])
    saturation_notes = []
    for name in SERVERS:
        system = summary["systems"].get(name, {})
        if system.get("status") != STATUS_OK:
            continue
        for _rate, figures in sorted(system.get("open", {}).items(), key=lambda kv: float(kv[0])):
            lines.append(_row(_latency_row(name, _num(figures["offered_rps"], 2), figures)))
        saturation = system.get("saturation")
        if saturation is not None:
            if not saturation["saturated"]:  # the reason says only that: give the bound instead
                note = (
                    f"not saturated within the sweep: it kept up with its highest rate, {saturation['load']} "
                    f"req/s ({saturation['request_rps']:.2f} achieved), a lower bound"
                )
            elif saturation["load"] is not None:
                note = f"saturation point {saturation['load']} req/s offered ({saturation['reason']})"
            else:
                note = f"saturated already at the lowest rate ({saturation['reason']})"
            saturation_notes.append(f"- {SYSTEM_TITLES[name]}: {note}")
    lines += [
        "",
        "Offered req/s is the rate the Poisson schedule actually produced; latency counts from each "
        "request's scheduled arrival (no coordinated omission).",
    ]
    if summary["plan"]["open_requests"] < FEW_OPEN_REQUESTS:
        lines += [
            "",
            f"Only {summary['plan']['open_requests']} requests per rate: achieved req/s counts up to the "
            "last completion, so draining the last requests weighs heavily and the saturation verdict "
            "below is unreliable.",
        ]
    return lines + (["", *saturation_notes] if saturation_notes else [])


def _cold_start_lines(summary: dict) -> list[str]:
    lines = ["## Cold start (reported apart; excluded from every table above)", ""]
    lines += _header(
        ["system", "spawn → ready", "first request TTFT", "first request E2E", "last warm-up E2E"]
    )
    for name in SERVERS:
        system = summary["systems"].get(name, {})
        cold = system.get("cold_start")
        if system.get("status") == STATUS_OK and cold:
            lines.append(
                _row(
                    [
                        SYSTEM_TITLES[name],
                        _ms(cold["ready_after_s"]),
                        _ms(cold["first_request_ttft_s"]),
                        _ms(cold["first_request_e2e_s"]),
                        _ms(cold["last_warmup_e2e_s"]),
                    ]
                )
            )
    hf = summary["systems"].get("hf", {})
    if hf.get("status") == STATUS_OK:
        lines.append(
            _row(
                [
                    SYSTEM_TITLES["hf"],
                    _ms(hf["load_s"]) + " (load)",
                    "—",
                    _ms(hf["warmup_s"]) + " (warm-up generate)",
                    "—",
                ]
            )
        )
    return lines


def _not_measured_lines(summary: dict) -> list[str]:
    lines = []
    for name, system in summary["systems"].items():
        if system.get("status") == STATUS_OK:
            continue
        first, *rest = (system.get("reason") or "").splitlines() or [""]
        lines.append(f"- {SYSTEM_TITLES[name]}: {system['status']}: {first}")
        if rest:  # a log tail: keep its lines as they are
            lines += ["", "  ```", *(f"  {line}" for line in rest), "  ```"]
    return ["## Not measured", "", *lines] if lines else []


def render_markdown(summary: dict) -> str:
    """The whole report; sections of systems that did not run are left out and listed at the end."""
    sections = [
        ["# kvpilot vs vLLM (CPU build) vs HF transformers", "", *environment_lines(summary)],
        _closed_throughput_lines(summary),
        _closed_latency_lines(summary),
        _open_loop_lines(summary),
        _cold_start_lines(summary),
        _not_measured_lines(summary),
        [
            "## Notes",
            "",
            f"- {THIN} p99 on fewer than 100 samples: noisy, shown for shape only.",
            "- Metric definitions and the system boundary (client side, one monotonic clock): "
            "`bench/README.md`. Per-request records and server logs: "
            + f"`{summary['environment']['work_dir']}`.",
            *(f"- {note}" for note in summary.get("notes", [])),
        ],
    ]
    return "\n\n".join("\n".join(section) for section in sections if section) + "\n"
