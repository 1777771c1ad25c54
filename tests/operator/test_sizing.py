"""N+1 sizing: exact examples and the invariants that must hold for every input."""

from __future__ import annotations

import math
from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st

from kvpilot.operator.sizing import size_for_spec, size_replicas
from kvpilot.operator.spec import AutoscalingSpec, InferenceServiceSpec, ModelSpec, ScalingSpec


def test_rate_mode_example_and_formula():
    result = size_replicas(ScalingSpec(target_requests_per_second=10, per_replica_goodput=4, headroom=0.2))
    assert (result.mode, result.serving, result.unclamped, result.desired) == ("Rate", 3, 4, 4)
    assert result.formula == "clamp(ceil(10 × (1 + 0.2) / 4) + 1, 1, 100) = 4"
    assert result.to_status()["desiredReplicas"] == 4


def test_exact_multiples_do_not_round_up():
    # 0.1 × 3 × (1 + 0) / 0.3 is exactly 1 in decimal, 1.0000000000000002 in floats
    result = size_replicas(ScalingSpec(target_requests_per_second=0.3, per_replica_goodput=0.1, headroom=0.0))
    assert result.serving == 3


def test_replicas_mode_and_clamps():
    assert size_replicas(ScalingSpec(replicas=2)).desired == 3
    assert size_replicas(ScalingSpec(replicas=2, spare=0, min_replicas=4)).desired == 4
    clamped = size_replicas(ScalingSpec(replicas=9, spare=2, max_replicas=10))
    assert (clamped.desired, clamped.disruption_allowance) == (10, 1)  # only one spare survived the clamp
    assert size_replicas(ScalingSpec()).desired == 2  # neither form: one replica plus the spare


rates = st.decimals(min_value=0, max_value=10_000, places=2).map(float)
goodputs = st.decimals(min_value=Fraction(1, 100), max_value=1000, places=2).map(float)


@given(
    rate=rates,
    goodput=goodputs,
    headroom=st.sampled_from([0.0, 0.1, 0.2, 0.5, 1.0]),
    spare=st.integers(0, 5),
    low=st.integers(0, 50),
    span=st.integers(0, 100),
)
def test_desired_is_the_clamped_n_plus_spare(rate, goodput, headroom, spare, low, span):
    scaling = ScalingSpec(
        target_requests_per_second=rate,
        per_replica_goodput=goodput,
        headroom=headroom,
        spare=spare,
        min_replicas=low,
        max_replicas=max(1, low + span),
    )
    result = size_replicas(scaling)
    exact = Fraction(str(rate)) * (1 + Fraction(str(headroom))) / Fraction(str(goodput))
    assert result.serving == math.ceil(exact)
    assert result.serving * Fraction(str(goodput)) >= Fraction(str(rate)) * (1 + Fraction(str(headroom)))
    assert scaling.min_replicas <= result.desired or result.desired == scaling.max_replicas
    assert result.desired <= scaling.max_replicas
    if scaling.min_replicas <= result.unclamped <= scaling.max_replicas:
        assert result.desired == result.serving + spare
    assert 0 <= result.disruption_allowance <= spare
    assert result.desired - result.disruption_allowance >= min(result.serving, result.desired)


@given(rate=rates, more=st.decimals(min_value=0, max_value=100, places=2).map(float), goodput=goodputs)
def test_more_load_never_means_fewer_replicas(rate, more, goodput):
    def desired(target):
        return size_replicas(
            ScalingSpec(target_requests_per_second=target, per_replica_goodput=goodput)
        ).desired

    assert desired(rate + more) >= desired(rate)


def _spec(mode: str, replicas: int | None, scaling: ScalingSpec) -> InferenceServiceSpec:
    return InferenceServiceSpec(
        model=ModelSpec(source="tiny-random", served_name="t"),
        scaling=scaling,
        autoscaling=AutoscalingSpec(mode=mode),
        replicas=replicas,
    )


def test_external_mode_follows_spec_replicas_unclamped():
    scaling = ScalingSpec(replicas=1, spare=1, max_replicas=4)
    result = size_for_spec(_spec("external", 7, scaling))
    # Unclamped: the HPA or KEDA object has its own bounds; clamping would fight it.
    assert (result.mode, result.serving, result.unclamped, result.desired) == ("External", 6, 7, 7)
    assert result.formula == "spec.replicas = 7 (autoscaling.mode external)"
    assert result.to_status()["specReplicas"] == 7
    assert result.disruption_allowance == 1


def test_external_mode_without_spec_replicas_uses_the_static_sizing_and_other_modes_ignore_it():
    scaling = ScalingSpec(replicas=2)
    unset = size_for_spec(_spec("external", None, scaling))
    assert (unset.mode, unset.desired, unset.formula) == (
        "External",
        3,
        "spec.replicas unset: clamp(2 + 1, 1, 100) = 3",
    )
    assert "specReplicas" not in unset.to_status()
    ignored = size_for_spec(_spec("off", 9, scaling))
    assert (ignored.mode, ignored.desired) == ("Replicas", 3)


def test_capacity_limited_only_when_n_itself_exceeds_max():
    eaten_spare = size_replicas(ScalingSpec(replicas=4, spare=1, max_replicas=4))
    assert (eaten_spare.desired, eaten_spare.capacity_limited) == (4, False)
    short = size_replicas(ScalingSpec(replicas=5, spare=1, max_replicas=4))
    assert (short.serving, short.desired, short.capacity_limited) == (5, 4, True)
    assert short.to_status()["capacityLimited"] is True


def test_external_mode_beyond_max_replicas_is_not_capacity_limited():
    # spec.replicas runs unclamped (the external autoscaler's bounds apply), so maxReplicas limits nothing.
    result = size_for_spec(_spec("external", 150, ScalingSpec(spare=1, max_replicas=100)))
    assert (result.serving, result.desired, result.capacity_limited) == (149, 150, False)
    assert result.to_status()["capacityLimited"] is False
    unset = size_for_spec(_spec("external", None, ScalingSpec(replicas=101, spare=1, max_replicas=100)))
    assert (unset.desired, unset.capacity_limited) == (100, True)  # the static sizing stands in, clamped
