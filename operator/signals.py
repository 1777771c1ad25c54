"""The autoscaler's signals: per-engine rates from the engines' counters (docs/architecture.md#autoscaling).

Two sources give the same ``EngineRates`` per pod over the rate window:

- **Pods** (default): the operator GETs each Ready engine's ``/metrics`` at every evaluation and keeps the
  samples of the last window (``SampleWindow``); a rate is (last - first) / span, PromQL's ``rate()``
  without extrapolation; a counter that went down (the engine restarted) starts that pod's window anew.
- **Prometheus** (``autoscaling.prometheusUrl``): the same quantities as instant queries, by pod
  (``prometheus_rates``), on series labelled ``namespace``, ``pod`` and ``inferenceservice`` (the chart's
  PodMonitor adds the last).

Per engine: arrivals = finished + turned away for capacity + the growth of what is in the engine
(running + waiting), so a load step shows at once, before anything finishes; goodput = requests that
finished within every SLO (``kvpilot_slo_attained_requests_total``, docs/metrics.md).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

#: rejections that are demand turned away for lack of capacity (a 400 is not demand; a queue_timeout is
#: counted as finished ``timeout`` already, docs/metrics.md)
CAPACITY_REJECTIONS = ("queue_full", "rate_limited")


@dataclass(frozen=True)
class EngineSample:
    """One engine's counters at one time (docs/metrics.md names)."""

    finished: float  # kvpilot_requests_finished_total, all reasons
    turned_away: float  # kvpilot_requests_rejected_total for CAPACITY_REJECTIONS
    in_engine: float  # kvpilot_num_requests_running + kvpilot_num_requests_waiting
    waiting: float  # kvpilot_num_requests_waiting
    attained: float  # kvpilot_slo_attained_requests_total

    def counters(self) -> tuple[float, float, float]:
        return self.finished, self.turned_away, self.attained


@dataclass(frozen=True)
class EngineRates:
    """One engine over the rate window, requests/s."""

    pod: str
    arrival: float
    finished: float
    attained: float
    waiting: float  # at the window's end


def parse_engine_metrics(text: str) -> EngineSample:
    """The counters the autoscaler reads, from a Prometheus text exposition."""
    sums = {"finished": 0.0, "turned_away": 0.0, "running": 0.0, "waiting": 0.0, "attained": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvpilot_requests_finished_total":
                sums["finished"] += sample.value
            elif sample.name == "kvpilot_requests_rejected_total":
                if sample.labels.get("reason") in CAPACITY_REJECTIONS:
                    sums["turned_away"] += sample.value
            elif sample.name == "kvpilot_num_requests_running":
                sums["running"] += sample.value
            elif sample.name == "kvpilot_num_requests_waiting":
                sums["waiting"] += sample.value
            elif sample.name == "kvpilot_slo_attained_requests_total":
                sums["attained"] += sample.value
    return EngineSample(
        finished=sums["finished"],
        turned_away=sums["turned_away"],
        in_engine=sums["running"] + sums["waiting"],
        waiting=sums["waiting"],
        attained=sums["attained"],
    )


def read_engine_metrics(host: str, port: int, timeout: float = 1.0) -> EngineSample | None:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as response:
            return parse_engine_metrics(response.read().decode())
    except (OSError, ValueError):
        return None


class SampleWindow:
    """Every pod's samples over the last ``window`` seconds."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._samples: dict[str, deque[tuple[float, EngineSample]]] = {}

    def add(self, now: float, samples: dict[str, EngineSample]) -> None:
        for pod in list(self._samples):
            if pod not in samples:  # gone (scaled down, replaced): its counters end with it
                del self._samples[pod]
        for pod, sample in samples.items():
            kept = self._samples.setdefault(pod, deque())
            if kept and any(
                new < old for new, old in zip(sample.counters(), kept[-1][1].counters(), strict=True)
            ):
                kept.clear()  # a counter reset: the engine restarted
            kept.append((now, sample))
            # Keep one sample at or before the window's start, so the rate spans the whole window.
            while len(kept) > 2 and now - kept[1][0] >= self.window:
                kept.popleft()

    def rates(self) -> list[EngineRates]:
        rates = []
        for pod, kept in sorted(self._samples.items()):
            if len(kept) < 2:
                continue
            (start, first), (end, last) = kept[0], kept[-1]
            span = end - start
            if span <= 0:
                continue
            arrived = (last.finished - first.finished) + (last.turned_away - first.turned_away)
            arrived += last.in_engine - first.in_engine
            rates.append(
                EngineRates(
                    pod=pod,
                    arrival=max(0.0, arrived / span),
                    finished=(last.finished - first.finished) / span,
                    attained=(last.attained - first.attained) / span,
                    waiting=last.waiting,
                )
            )
        return rates


def _query(url: str, promql: str, timeout: float) -> dict[str, float]:
    """An instant query's vector as {pod: value}."""
    target = f"{url.rstrip('/')}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(target, timeout=timeout) as response:
        body = json.loads(response.read())
    if body.get("status") != "success":
        raise ValueError(f"Prometheus query failed: {body.get('error', body)}")
    return {item["metric"].get("pod", ""): float(item["value"][1]) for item in body["data"]["result"]}


def prometheus_rates(
    url: str, namespace: str, name: str, window: int, timeout: float = 2.0
) -> list[EngineRates] | None:
    """The same rates as ``SampleWindow.rates``, from Prometheus; None when it cannot be asked."""
    selector = f'namespace="{namespace}",inferenceservice="{name}"'
    rejected = "|".join(CAPACITY_REJECTIONS)
    queries = {
        "finished": f"sum by (pod) (rate(kvpilot_requests_finished_total{{{selector}}}[{window}s]))",
        "turned_away": (
            f'sum by (pod) (rate(kvpilot_requests_rejected_total{{{selector},reason=~"{rejected}"}}'
            f"[{window}s]))"
        ),
        "growth": (
            f"sum by (pod) (delta(kvpilot_num_requests_running{{{selector}}}[{window}s]) + "
            f"delta(kvpilot_num_requests_waiting{{{selector}}}[{window}s])) / {window}"
        ),
        "attained": f"sum by (pod) (rate(kvpilot_slo_attained_requests_total{{{selector}}}[{window}s]))",
        "waiting": f"max by (pod) (kvpilot_num_requests_waiting{{{selector}}})",
    }
    try:
        values = {key: _query(url, promql, timeout) for key, promql in queries.items()}
    except (OSError, ValueError, KeyError, urllib.error.URLError):
        return None
    return [
        EngineRates(
            pod=pod,
            arrival=max(
                0.0,
                values["finished"][pod]
                + values["turned_away"].get(pod, 0.0)
                + values["growth"].get(pod, 0.0),
            ),
            finished=values["finished"][pod],
            attained=values["attained"].get(pod, 0.0),
            waiting=values["waiting"].get(pod, 0.0),
        )
        for pod in sorted(values["finished"])
        if pod
    ]


def parse_activator_metrics(text: str) -> tuple[float, float]:
    """(held now, held since start) from the activator's /metrics (``operator/activator.py``)."""
    held = held_total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvpilot_activator_held_requests":
                held = sample.value
            elif sample.name == "kvpilot_activator_held_total":
                held_total = sample.value
    return held, held_total


def read_activator_metrics(host: str, port: int, timeout: float = 1.0) -> tuple[float, float] | None:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as response:
            return parse_activator_metrics(response.read().decode())
    except (OSError, ValueError):
        return None
