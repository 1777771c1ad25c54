"""The autoscaler's pure decision: exact counts on a fake clock, the windows and the cooldown."""

from __future__ import annotations

import pytest

from kvpilot.operator.autoscale_decision import (
    HOLD,
    NO_SIGNAL,
    SCALE_DOWN,
    SCALE_UP,
    Inputs,
    Policy,
    Recommendation,
    decide,
    serving_replicas,
)

POLICY = Policy(
    headroom=0.25,
    spare=1,
    min_replicas=1,
    max_replicas=6,
    up_window_seconds=0,
    down_window_seconds=60,
    cooldown_seconds=30,
)


class Run:
    """Feeds one measurement per call through decide, carrying the history and the count like the
    operator does, on a clock the test moves."""

    def __init__(self, policy: Policy = POLICY, current: int = 2, goodput: float = 2.0) -> None:
        self.policy, self.current, self.goodput = policy, current, goodput
        self.history: tuple[Recommendation, ...] = ()
        self.last_scale_at: float | None = None

    def at(self, now: float, rate: float | None) -> tuple[str, int]:
        decision = decide(
            Inputs(now, self.current, rate, self.goodput, self.history, self.last_scale_at), self.policy
        )
        self.history = decision.history
        if decision.changed:
            self.current, self.last_scale_at = decision.desired, now
        return decision.decision, decision.desired


def test_the_formula_with_exact_arithmetic():
    assert serving_replicas(4.8, 0.25, 2.0) == 3  # 4.8 x 1.25 / 2 = 3 exactly, not 3.0000000000000004
    assert serving_replicas(4.81, 0.25, 2.0) == 4
    assert serving_replicas(0.0, 0.25, 2.0) == 0
    decision = decide(Inputs(now=0, current=2, arrival_rate=4.8, goodput=2.0), POLICY)
    assert (decision.serving, decision.unclamped, decision.recommendation) == (3, 4, 4)
    assert decision.formula == "clamp(ceil(4.8 × (1 + 0.25) / 2) + 1, 1, 6) = 4"
    assert (decision.decision, decision.desired) == (SCALE_UP, 4)
    assert decision.message == "2 -> 4: lowest recommendation of the last 0 s"


def test_up_fast_down_slow_with_the_cooldown():
    run = Run()
    assert run.at(0, 1.0) == (HOLD, 2)  # ceil(1 x 1.25 / 2) + 1 = 2
    assert run.at(10, 7.0) == (SCALE_UP, 6)  # ceil(4.375) + 1 = 6: at once
    assert run.at(20, 1.0) == (HOLD, 6)  # 2 recommended, but 6 was recommended within the 60 s window
    assert run.at(69, 1.0) == (HOLD, 6)  # the 6 at t=10 is still in [9, 69]
    assert run.at(71, 1.0) == (SCALE_DOWN, 2)  # the window holds only 2s now; cooldown long over
    assert run.at(75, 3.3) == (SCALE_UP, 4)  # ceil(2.0625) + 1 = 4
    assert run.at(140, 0.0) == (SCALE_DOWN, 1)  # 0 load: N 0 + spare 1


def test_cooldown_holds_a_scale_down_but_never_a_scale_up():
    policy = Policy(
        headroom=0, spare=0, min_replicas=1, max_replicas=10, down_window_seconds=0, cooldown_seconds=30
    )
    run = Run(policy, current=1, goodput=1.0)
    assert run.at(0, 5.0) == (SCALE_UP, 5)
    decision = decide(Inputs(10, 5, 2.0, 1.0, run.history, run.last_scale_at), policy)
    assert (decision.decision, decision.desired) == (HOLD, 5)
    assert decision.message == "5 kept: 2 recommended, but the last change was 10 s ago (cooldown 30 s)"
    assert run.at(10, 8.0) == (SCALE_UP, 8)  # up is not held by the cooldown
    assert run.at(39, 2.0) == (HOLD, 8)  # 29 s after the last change
    assert run.at(40, 2.0) == (SCALE_DOWN, 2)


def test_up_window_takes_the_lowest_recommendation():
    policy = Policy(
        headroom=0,
        spare=0,
        min_replicas=1,
        max_replicas=10,
        up_window_seconds=20,
        down_window_seconds=0,
        cooldown_seconds=0,
    )
    run = Run(policy, current=1, goodput=1.0)
    assert run.at(0, 1.0) == (HOLD, 1)
    assert run.at(10, 6.0) == (HOLD, 1)  # the 1 at t=0 is within the 20 s up window
    assert run.at(21, 6.0) == (SCALE_UP, 6)  # only 6s left in [1, 21]


def test_clamps_and_bounds():
    decision = decide(Inputs(now=0, current=3, arrival_rate=100.0, goodput=2.0), POLICY)
    # N = 63 exceeds maxReplicas: recommendation is the max, the unclamped count says how far short
    assert (decision.serving, decision.unclamped, decision.recommendation, decision.desired) == (63, 64, 6, 6)
    shrunk = decide(Inputs(now=0, current=9, arrival_rate=100.0, goodput=2.0), POLICY)
    assert (shrunk.decision, shrunk.desired, shrunk.message) == (SCALE_DOWN, 6, "9 -> 6: outside [1, 6]")


def test_no_signal_keeps_the_count_within_bounds():
    decision = decide(Inputs(now=0, current=3, arrival_rate=None, goodput=2.0), POLICY)
    assert (decision.decision, decision.desired, decision.history) == (NO_SIGNAL, 3, ())
    assert decision.message == "no arrival rate measured yet; keeping 3"
    raised = decide(Inputs(now=0, current=0, arrival_rate=None, goodput=2.0), POLICY)
    assert (raised.decision, raised.desired) == (SCALE_UP, 1)


def test_history_is_pruned_to_the_longer_window():
    run = Run()
    for second in range(0, 200, 10):
        run.at(second, 1.0)
    assert [r.at for r in run.history] == [130, 140, 150, 160, 170, 180, 190]


def test_goodput_must_be_positive():
    with pytest.raises(ValueError, match="goodput must be positive"):
        serving_replicas(1.0, 0.2, 0.0)
