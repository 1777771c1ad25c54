"""The comparison's PNG plots, drawn from its ``summary.json`` dict.

- ``throughput_by_concurrency.png``: output tok/s against closed-loop concurrency (HF: batch size) for
  every measured system, the issue's reference figures (dashed) and the fp32 GEMM ceiling.
- ``open_loop_latency.png``: p50/p99 TTFT and p50 TPOT against the offered Poisson rate, per server.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a display; must precede the pyplot import
import matplotlib.pyplot as plt
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

from kvpilot.bench.compare.results import (
    GEMM_CEILING_OUTPUT_TPS,
    REFERENCE_OUTPUT_TPS,
    SERVERS,
    STATUS_OK,
    SYSTEM_TITLES,
    output_tps_by_level,
)
from kvpilot.bench.plots import to_ms

THROUGHPUT_PNG = "throughput_by_concurrency.png"
OPEN_LOOP_PNG = "open_loop_latency.png"
COLORS = {"hf": "tab:gray", "vllm": "tab:blue", "llamacpp": "tab:green", "kvpilot": "tab:orange"}


def plot_throughput(summary: dict, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in SYSTEM_TITLES:
        measured = output_tps_by_level(summary["systems"].get(name, {}))
        if measured:
            levels = sorted(measured)
            ax.plot(
                levels,
                [measured[c] for c in levels],
                "o-",
                color=COLORS[name],
                label=f"{SYSTEM_TITLES[name]} (measured)",
            )
        reference = REFERENCE_OUTPUT_TPS.get(name)
        if reference:
            levels = sorted(reference)
            ax.plot(
                levels,
                [reference[c] for c in levels],
                "s--",
                color=COLORS[name],
                alpha=0.5,
                markerfacecolor="none",
                label=f"{SYSTEM_TITLES[name]} (issue's figures)",
            )
    ax.axhline(
        GEMM_CEILING_OUTPUT_TPS,
        color="black",
        linestyle=":",
        linewidth=1,
        label=f"fp32 GEMM ceiling ≈ {GEMM_CEILING_OUTPUT_TPS:.0f}",
    )
    ax.set_xscale("log", base=2)
    reference_levels = {level for figures in REFERENCE_OUTPUT_TPS.values() for level in figures}
    ax.set_xticks(sorted(set(summary["plan"]["concurrencies"]) | reference_levels))
    _plain_numbers(ax.xaxis)
    ax.set_xlabel("closed-loop concurrency (HF: batch size)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(
        f"SmolLM2-135M fp32, {summary['plan']['output_len']} greedy tokens, "
        f"{summary['environment']['cpu_count']} cores"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_open_loop(summary: dict, path: Path) -> Path | None:
    servers = [
        name
        for name in SERVERS
        if summary["systems"].get(name, {}).get("status") == STATUS_OK
        and summary["systems"][name].get("open")
    ]
    if not servers:
        return None
    fig, (ax_ttft, ax_tpot) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in servers:
        points = sorted(summary["systems"][name]["open"].values(), key=lambda p: p["offered_rps"])
        x = [p["offered_rps"] for p in points]
        for stat, style in (("p50", "o-"), ("p99", "s--")):
            ttft = [to_ms(p["ttft_s"][stat]) for p in points]
            ax_ttft.plot(x, ttft, style, color=COLORS[name], label=f"{SYSTEM_TITLES[name]} TTFT {stat}")
        ax_tpot.plot(
            x,
            [to_ms(p["tpot_s"]["p50"]) for p in points],
            "o-",
            color=COLORS[name],
            label=f"{SYSTEM_TITLES[name]} TPOT p50",
        )
    for ax, what in ((ax_ttft, "TTFT"), (ax_tpot, "TPOT")):
        ax.set_xscale("log", base=2)  # the sweep's rates are geometric
        ax.set_xticks(sorted(summary["plan"]["request_rates"]))
        ax.set_yscale("log")  # latency grows by orders of magnitude past the knee
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        _plain_numbers(ax.xaxis)
        _plain_numbers(ax.yaxis)
        ax.set_xlabel("offered request rate (Poisson), req/s")
        ax.set_ylabel(f"{what}, ms (log)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Open loop: latency from scheduled arrival against offered load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plain_numbers(axis: matplotlib.axis.Axis) -> None:
    """Log-scaled axes labelled 250, 500, 1000 rather than 2.5 x 10^2."""
    axis.set_major_formatter(ScalarFormatter())
    axis.set_minor_formatter(NullFormatter())


def write_plots(summary: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        plot_throughput(summary, out_dir / THROUGHPUT_PNG),
        plot_open_loop(summary, out_dir / OPEN_LOOP_PNG),
    ]
    return [path for path in paths if path is not None]
