"""The autoscaler around the pure decision: engine counters to rates, the goodput estimate, the
status fields and Events, on a fake clock with engines the test drives."""

from __future__ import annotations

from kvpilot.operator.autoscaler import Autoscaler
from kvpilot.operator.signals import EngineRates, EngineSample, SampleWindow, parse_engine_metrics
from kvpilot.operator.spec import InferenceService

EXPOSITION = """\
# TYPE kvpilot_requests_finished_total counter
kvpilot_requests_finished_total{model_name="m",finished_reason="stop"} 7.0
kvpilot_requests_finished_total{model_name="m",finished_reason="length"} 3.0
kvpilot_requests_finished_total{model_name="m",finished_reason="timeout"} 1.0
# TYPE kvpilot_requests_rejected_total counter
kvpilot_requests_rejected_total{model_name="m",reason="queue_full"} 2.0
kvpilot_requests_rejected_total{model_name="m",reason="queue_timeout"} 1.0
kvpilot_requests_rejected_total{model_name="m",reason="invalid_request"} 5.0
# TYPE kvpilot_num_requests_running gauge
kvpilot_num_requests_running{model_name="m"} 4.0
# TYPE kvpilot_num_requests_waiting gauge
kvpilot_num_requests_waiting{model_name="m"} 2.0
# TYPE kvpilot_slo_attained_requests_total counter
kvpilot_slo_attained_requests_total{model_name="m"} 9.0
"""


def test_engine_metrics_are_parsed_into_the_counters_the_autoscaler_reads():
    # queue_timeout is already a finished timeout and invalid_request is no demand: neither counts again
    assert parse_engine_metrics(EXPOSITION) == EngineSample(
        finished=11.0, turned_away=2.0, in_engine=6.0, waiting=2.0, attained=9.0
    )


def sample(finished: float, attained: float, in_engine: float = 0.0, waiting: float = 0.0) -> EngineSample:
    return EngineSample(
        finished=finished, turned_away=0.0, in_engine=in_engine, waiting=waiting, attained=attained
    )


def test_window_rates_span_the_window_and_restart_on_a_counter_reset():
    window = SampleWindow(20)
    window.add(0, {"a": sample(0, 0)})
    assert window.rates() == []  # one sample is no rate
    window.add(10, {"a": sample(30, 30, in_engine=5)})
    # arrivals = 30 finished + 5 now in the engine, over 10 s
    assert window.rates() == [EngineRates("a", arrival=3.5, finished=3.0, attained=3.0, waiting=0.0)]
    window.add(20, {"a": sample(50, 40, in_engine=5, waiting=1)})
    window.add(30, {"a": sample(60, 50, in_engine=0)})
    # the samples at 10, 20, 30 remain: (60 - 30 + 0 - 5) / 20
    assert window.rates() == [EngineRates("a", arrival=1.25, finished=1.5, attained=1.0, waiting=0.0)]
    window.add(40, {"a": sample(2, 2), "b": sample(0, 0)})  # a restarted; b is new
    assert window.rates() == []
    window.add(50, {"b": sample(10, 10)})  # a is gone
    assert window.rates() == [EngineRates("b", arrival=1.0, finished=1.0, attained=1.0, waiting=0.0)]


def isvc(**autoscaling) -> InferenceService:
    return InferenceService.from_manifest(
        {
            "apiVersion": "kvpilot.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "smol", "namespace": "ml", "uid": "u1", "generation": 1},
            "spec": {
                "model": {"source": "tiny-random"},
                "scaling": {"perReplicaGoodput": 2, "headroom": 0.25, "spare": 1, "maxReplicas": 4},
                "autoscaling": {
                    "mode": "operator",
                    "intervalSeconds": 10,
                    "rateWindowSeconds": 10,
                    "scaleDownStabilizationSeconds": 30,
                    "cooldownSeconds": 0,
                    "minGoodputSamples": 2,
                    **autoscaling,
                },
            },
        }
    )


class Engines:
    """Counters per pod that the test advances; read by the autoscaler as by GET /metrics."""

    def __init__(self) -> None:
        self.samples: dict[tuple[str, int], EngineSample] = {}
        self.now = 0.0

    def read(self, host: str, port: int) -> EngineSample | None:
        return self.samples.get((host, port))

    def advance(self, seconds: float, per_pod: dict[str, tuple[float, float, float]]) -> None:
        """Each pod finishes ``finished`` and attains ``attained`` per second, with ``waiting`` queued."""
        self.now += seconds
        for host, (finished, attained, waiting) in per_pod.items():
            old = self.samples.get((host, 8000), sample(0, 0))
            self.samples[(host, 8000)] = sample(
                old.finished + finished * seconds,
                old.attained + attained * seconds,
                in_engine=waiting,
                waiting=waiting,
            )


def test_a_load_step_scales_up_measures_goodput_and_scales_down_after_the_window():
    engines = Engines()
    scaler = Autoscaler(clock=lambda: engines.now, read_metrics=engines.read)
    service = isvc()
    pods = {"p1": ("10.0.0.1", 8000), "p2": ("10.0.0.2", 8000)}

    engines.advance(0, {"10.0.0.1": (0, 0, 0), "10.0.0.2": (0, 0, 0)})
    first = scaler.evaluate(service, pods, {})
    # no rate yet: the static sizing's count (goodput alone: 1 serving + 1 spare), NoSignal
    assert (first.sizing.desired, dict(first.sizing.extra)["decision"], first.events) == (2, "NoSignal", ())
    assert first.next_in == 10

    # 1 req/s each, unsaturated: λ 2 → ceil(2 × 1.25 / 2) + 1 = 3
    engines.advance(10, {"10.0.0.1": (1, 1, 0), "10.0.0.2": (1, 1, 0)})
    up = scaler.evaluate(service, pods, {})
    status = up.sizing.to_status()
    assert (status["desiredReplicas"], status["decision"], status["arrivalRate"]) == (3, "ScaleUp", 2.0)
    assert (status["goodput"], status["goodputSource"], status["goodputSamples"]) == (2.0, "Spec", 0)
    assert status["formula"] == "clamp(ceil(2 × (1 + 0.25) / 2) + 1, 1, 4) = 3"
    assert [(e.type, e.reason) for e in up.events] == [("Normal", "ScaledUp")]
    assert up.events[0].message == "2 -> 3: lowest recommendation of the last 0 s; " + status["formula"]

    # A reconcile 3 s later (a watch event) reuses the evaluation: no new sample, no event.
    # From here both are saturated (a queue of 3), finishing 2 req/s and attaining 1.5 req/s each.
    load = {"10.0.0.1": (2, 1.5, 3), "10.0.0.2": (2, 1.5, 3)}
    engines.advance(3, load)
    again = scaler.evaluate(service, pods, {})
    assert (again.sizing, again.events, again.next_in) == (up.sizing, (), 7)

    # Two saturated samples → measured g = 1.5.
    engines.advance(7, load)
    saturated = scaler.evaluate(service, pods, {}).sizing.to_status()
    assert (saturated["goodputSource"], saturated["goodputSamples"], saturated["goodput"]) == (
        "Measured",
        2,
        1.5,
    )
    # λ = (40 finished + 6 queued - 0) / 10 s... per pod (2 × 10 + 3) / 10 = 2.3, total 4.6:
    # ceil(4.6 × 1.25 / 1.5) + 1 = ceil(3.833) + 1 = 5, clamped to maxReplicas 4
    assert (saturated["arrivalRate"], saturated["serving"], saturated["unclamped"]) == (4.6, 4, 5)
    assert (saturated["desiredReplicas"], saturated["capacityLimited"]) == (4, False)

    # The load goes: down only after the 30 s window has seen nothing higher.
    for _ in range(3):
        engines.advance(10, {"10.0.0.1": (0, 0, 0), "10.0.0.2": (0, 0, 0)})
        held = scaler.evaluate(service, pods, {})
        assert held.sizing.desired == 4
    engines.advance(10, {"10.0.0.1": (0, 0, 0), "10.0.0.2": (0, 0, 0)})
    down = scaler.evaluate(service, pods, {})
    assert (down.sizing.desired, [e.reason for e in down.events]) == (1, ["ScaledDown"])
    assert down.sizing.to_status()["lastScaleTime"] == "1970-01-01T00:01:00Z"  # 40 s after the last 4


def test_capacity_limited_warns_once_with_n_and_a_restart_continues_from_the_status():
    engines = Engines()
    scaler = Autoscaler(clock=lambda: engines.now, read_metrics=engines.read)
    service = isvc()
    pods = {"p1": ("10.0.0.1", 8000)}
    engines.advance(0, {"10.0.0.1": (0, 0, 0)})
    scaler.evaluate(service, pods, {})
    engines.advance(10, {"10.0.0.1": (8, 8, 0)})
    limited = scaler.evaluate(service, pods, {})
    # N = ceil(8 × 1.25 / 2) = 5 > maxReplicas 4
    assert (limited.sizing.serving, limited.sizing.desired, limited.sizing.capacity_limited) == (5, 4, True)
    assert [(e.type, e.reason) for e in limited.events] == [
        ("Normal", "ScaledUp"),
        ("Warning", "CapacityLimited"),
    ]
    assert (
        limited.events[1].message
        == "5 replicas needed to serve 8 requests/s within the SLO, scaling.maxReplicas is 4"
    )
    engines.advance(10, {"10.0.0.1": (8, 8, 0)})
    assert scaler.evaluate(service, pods, {}).events == ()  # still limited: no second warning

    restarted = Autoscaler(clock=lambda: engines.now, read_metrics=engines.read)
    previous = {"sizing": limited.sizing.to_status()}
    engines.advance(10, {"10.0.0.1": (8, 8, 0)})
    resumed = restarted.evaluate(service, pods, previous)
    # the count and the last scale time come from the status: no rate yet, 4 kept
    assert (resumed.sizing.desired, dict(resumed.sizing.extra)["lastScaleTime"]) == (
        4,
        "1970-01-01T00:00:10Z",
    )


def test_prometheus_source_is_used_when_configured():
    calls = []

    def prometheus(url: str, namespace: str, name: str, window: int) -> list[EngineRates]:
        calls.append((url, namespace, name, window))
        return [EngineRates("p1", arrival=3.0, finished=3.0, attained=3.0, waiting=0.0)]

    scaler = Autoscaler(clock=lambda: 100.0, read_prometheus=prometheus, read_metrics=lambda h, p: None)
    evaluation = scaler.evaluate(isvc(prometheusUrl="http://prom:9090"), {}, {})
    status = evaluation.sizing.to_status()
    assert calls == [("http://prom:9090", "ml", "smol", 10)]
    assert (status["signalSource"], status["arrivalRate"], status["desiredReplicas"]) == (
        "Prometheus",
        3.0,
        3,
    )


def test_idle_scales_to_zero_and_a_held_request_wakes_it_at_once():
    engines = Engines()
    held = {"now": 0.0, "total": 0.0}
    scaler = Autoscaler(
        clock=lambda: engines.now,
        read_metrics=engines.read,
        read_activator=lambda h, p: (held["now"], held["total"]),
    )
    service = isvc(idleTimeoutSeconds=25, scaleDownStabilizationSeconds=10)
    assert service.spec.scales_to_zero is False  # minReplicas 1 in this spec
    zero = InferenceService.from_manifest(
        {
            "apiVersion": "kvpilot.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "smol", "namespace": "ml", "uid": "u1", "generation": 1},
            "spec": {
                "model": {"source": "tiny-random"},
                "scaling": {"perReplicaGoodput": 2, "spare": 1, "minReplicas": 0, "maxReplicas": 4},
                "autoscaling": {
                    "mode": "operator",
                    "intervalSeconds": 10,
                    "rateWindowSeconds": 10,
                    "scaleDownStabilizationSeconds": 10,
                    "cooldownSeconds": 0,
                    "idleTimeoutSeconds": 25,
                },
            },
        }
    )
    assert zero.spec.scales_to_zero
    pods, activator = {"p1": ("10.0.0.1", 8000)}, ("10.0.0.9", 8080)
    counts = []
    for _ in range(6):  # no load at all
        engines.advance(10, {"10.0.0.1": (0, 0, 0)})
        counts.append(scaler.evaluate(zero, pods, {}, activator).sizing.desired)
    # t=10: NoSignal keeps 2 (1 + spare); t=20: N 0 + spare 1 = 1 (the spare stays until idle);
    # idle from the evaluation at t=40 (25 s after the first look at t=10): 0 is recommended, and taken
    # at t=50, once the 10 s down window holds nothing higher
    assert counts == [2, 1, 1, 1, 0, 0]
    at_zero = scaler.evaluate(zero, {}, {}, activator)  # reused: no new evaluation within the interval
    assert at_zero.sizing.desired == 0
    engines.advance(10, {})
    assert scaler.evaluate(zero, {}, {}, activator).sizing.desired == 0  # still idle
    held.update(now=20.0, total=20.0)  # 20 requests arrive at the activator
    engines.advance(10, {})
    woken = scaler.evaluate(zero, {}, {}, activator)
    assert (woken.sizing.desired, [e.reason for e in woken.events]) == (1, ["ScaledUp"])
