"""PNG plots of a run: latency against achieved throughput, and latency CDFs per load point."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a display; must precede the pyplot import
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import LogFormatter

from kvpilot.bench.runner import PointResult
from kvpilot.bench.saturation import SaturationResult

THROUGHPUT_LATENCY_PNG = "throughput_vs_latency.png"
LATENCY_CDF_PNG = "latency_cdf.png"


def _load_name(point: PointResult) -> str:
    return f"c={int(point.load)}" if point.mode == "closed" else f"{point.load:g} req/s"


def plot_throughput_latency(
    points: Sequence[PointResult], saturation: SaturationResult | None, path: Path
) -> Path:
    """p50/p99 TTFT and TPOT (ms, log scale) against achieved request throughput, one marker per point."""
    x = [p.summary.request_throughput_rps for p in points]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, metric, title in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        for stat, style in (("p50", "o-"), ("p99", "s--")):
            y = [to_ms(getattr(getattr(p.summary, metric), stat)) for p in points]
            ax.plot(x, y, style, label=f"{title} {stat}")
        for point, xi in zip(points, x, strict=True):
            value = to_ms(getattr(point.summary, metric).p50)
            if not np.isnan(value):
                ax.annotate(
                    _load_name(point), (xi, value), textcoords="offset points", xytext=(4, -12), fontsize=7
                )
        if saturation is not None and saturation.saturated and saturation.saturation_index is not None:
            ax.axvline(
                x[saturation.saturation_index],
                color="grey",
                linestyle=":",
                label="saturation point (highest sustained load)",
            )
        ax.set_xlabel("achieved request throughput (req/s, successful requests)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_yscale("log")
        _plain_log_labels(ax.yaxis)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"{title} vs throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency_cdfs(points: Sequence[PointResult], path: Path) -> Path:
    """Empirical CDFs of TTFT, TPOT and E2E (ms, log scale), one line per load point."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, getter, title in (
        (axes[0], "ttft_s", "TTFT"),
        (axes[1], "tpot_s", "TPOT"),
        (axes[2], "e2e_s", "E2E"),
    ):
        for point in points:
            values = np.sort([v for r in point.records if (v := getattr(r, getter)) is not None])
            if values.size == 0:
                continue
            fraction = np.arange(1, values.size + 1) / values.size
            ax.step(values * 1e3, fraction, where="post", label=f"{_load_name(point)} (n={values.size})")
        ax.set_xscale("log")
        _plain_log_labels(ax.xaxis)
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{title} CDF")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(
    points: Sequence[PointResult], saturation: SaturationResult | None, directory: Path
) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    return [
        plot_throughput_latency(points, saturation, directory / THROUGHPUT_LATENCY_PNG),
        plot_latency_cdfs(points, directory / LATENCY_CDF_PNG),
    ]


def _plain_log_labels(axis: matplotlib.axis.Axis) -> None:
    """Plain numbers on a log axis, minor ticks labelled only when the range is narrow (else 4×10^0 style)."""
    axis.set_major_formatter(LogFormatter(labelOnlyBase=False))
    axis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1.5, 0.6)))


def to_ms(value: float | None) -> float:
    """Seconds → milliseconds; None (not measured) → NaN, which matplotlib leaves out of a line."""
    return float("nan") if value is None else value * 1e3
