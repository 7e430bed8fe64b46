"""The autoscaling rule (`autoscale.decide`), by properties over loads and times: within its
bounds always, up at once and enough, down one at a time and never into an overload, no
flapping on a square wave faster than its down delay, to zero after the idle time, from any
count."""

from __future__ import annotations

import itertools
import math

from hypothesis import given
from hypothesis import strategies as st

from modelfleet.core.autoscale import (
    BURST,
    BURST_WAIT,
    DOWN_MARGIN,
    Decision,
    Policy,
    Trend,
    decide,
    up_due,
)


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    most = draw(st.integers(1, 12))
    return Policy(
        min=draw(st.integers(0, most)),
        max=most,
        target_in_flight=draw(st.floats(0.5, 16)),
        scale_up_after=draw(st.floats(0, 5)),
        scale_down_after=draw(st.floats(1, 60)),
        scale_to_zero_after=draw(st.floats(1, 120)),
    )


def run(policy: Policy, loads: list[float], current: int, step: float = 1.0) -> list[Decision]:
    """Decide every `step` seconds, taking each decision, the load at each time given."""
    trend, made = Trend(), []
    for i, load in enumerate(loads):
        decision = decide(policy, current, load, i * step, trend)
        made.append(decision)
        current, trend = decision.replicas, decision.trend
    return made


@given(
    policy=policies(),
    current=st.integers(0, 20),
    loads=st.lists(st.floats(0, 200), min_size=1, max_size=60),
    floor=st.integers(0, 20),
)
def test_the_count_stays_within_the_bounds_and_the_floor(
    policy: Policy, current: int, loads: list[float], floor: int
) -> None:
    trend = Trend()
    least = max(policy.min, min(floor, policy.max))
    for i, load in enumerate(loads):
        d = decide(policy, current, load, float(i), trend, floor)
        assert least <= d.replicas <= policy.max or (d.replicas == 1 and least == 0), d
        assert d.reason
        current, trend = d.replicas, d.trend


@given(policy=policies(), load=st.floats(0.1, 200), current=st.integers(1, 12))
def test_load_over_the_target_goes_up_once_and_enough(
    policy: Policy, load: float, current: int
) -> None:
    current = min(max(current, policy.min, 1), policy.max)
    steps = math.ceil(policy.scale_up_after / 0.5) + 1
    made = run(policy, [load] * steps, current, step=0.5)
    enough = min(policy.max, max(policy.min, math.ceil(load / policy.target_in_flight)))
    if load / current > policy.target_in_flight and current < policy.max:
        ups = [d for d in made if d.replicas > current]
        assert ups, "no scale up"
        first = ups[0]
        assert first.replicas >= enough  # the whole way in one step
        assert first.reason.startswith("up")


@given(
    policy=policies(),
    load=st.floats(0, 100),
    current=st.integers(1, 12),
    length=st.integers(1, 400),
)
def test_a_constant_load_never_goes_down_and_up_again(
    policy: Policy, load: float, current: int, length: int
) -> None:
    current = min(max(current, policy.min), policy.max)
    made = run(policy, [load] * length, current)
    counts = [current, *(d.replicas for d in made)]
    went_down = False
    for before, after in itertools.pairwise(counts):
        if after < before:
            went_down = True
            if after > 0:
                assert before - after == 1  # one at a time
                assert load / after < policy.target_in_flight  # never into an overload
        if after > before:
            assert not went_down, counts  # no flapping


@given(policy=policies(), high=st.floats(10, 100), low_share=st.floats(0, 0.5))
def test_a_square_wave_faster_than_the_down_delay_takes_no_replica_away(
    policy: Policy, high: float, low_share: float
) -> None:
    half = max(1, math.floor(policy.scale_down_after * 0.9))  # each half period, whole seconds
    low = high * low_share
    loads = ([high] * half + [low] * half) * 6
    start = min(policy.max, max(policy.min, 1, math.ceil(high / policy.target_in_flight)))
    made = run(policy, loads, start)
    if policy.min > 0 or low > 0:
        assert all(d.replicas >= start for d in made), [d.replicas for d in made]


@given(policy=policies())
def test_to_zero_only_after_the_idle_time_and_up_at_once_when_asked(policy: Policy) -> None:
    policy = Policy(**{**policy.__dict__, "min": 0})
    idle = math.ceil(policy.scale_to_zero_after) + math.ceil(policy.scale_down_after) * 20 + 5
    made = run(policy, [0.0] * idle + [3.0], policy.max)
    zero_at = next(i for i, d in enumerate(made) if d.replicas == 0)
    # From the last request, whatever it had then (issue 41: stepping down one at a time
    # first made it `scale_down_after` per replica).
    assert policy.scale_to_zero_after <= zero_at == math.ceil(policy.scale_to_zero_after)
    assert made[-1].replicas >= 1 and made[-1].reason.startswith("up from zero")


def test_the_reason_carries_the_numbers() -> None:
    policy = Policy(min=1, max=4, target_in_flight=8, scale_up_after=2)
    first = decide(policy, 2, 30, 0.0, Trend())
    assert first.replicas == 2 and first.trend.over_since == 0.0
    assert first.trend.burst_since is None  # 15 each: over 8, not twice it
    later = decide(policy, 2, 30, 2.0, first.trend)
    assert later.replicas == 4  # 30 / 8 -> 4 at once
    assert later.reason == "up: over the target for 2.0s: load 30 on 2 replica(s), target 8 each"
    burst = decide(policy, 1, 30, 1.0, decide(policy, 1, 30, 0.0, Trend()).trend)
    assert burst.replicas == 4
    assert burst.reason == (
        "up: a burst, 3.8x the target for 1.0s: load 30 on 1 replica(s), target 8 each"
    )
    assert DOWN_MARGIN < 1


@given(
    policy=policies(),
    current=st.integers(1, 12),
    times=st.one_of(st.floats(1.05, 1.95), st.floats(2.05, 6)),
)
def test_over_the_target_waits_scale_up_after_and_a_burst_its_share_of_it(
    policy: Policy, current: int, times: float
) -> None:
    current = min(max(current, policy.min), policy.max)
    if current == policy.max:
        return
    load = times * policy.target_in_flight * current
    step = 0.05
    made = run(policy, [load] * (math.ceil(policy.scale_up_after / step) + 2), current, step)
    up_at = next(i for i, d in enumerate(made) if d.replicas > current) * step
    wait = policy.scale_up_after * (BURST_WAIT if times >= BURST else 1)
    assert wait - 1e-9 <= up_at < wait + step + 1e-9, (up_at, wait, made[0].trend)
    if up_at > 0:  # the first decision waited: it says when the wait ends
        assert up_due(policy, made[0].trend) == wait


@given(policy=policies(), current=st.integers(1, 12), held=st.integers(1, 200))
def test_held_requests_scale_up_at_once_to_what_the_load_needs(
    policy: Policy, current: int, held: int
) -> None:
    current = min(current, policy.max)
    load = float(held + current)  # some in flight, the rest held
    decision = decide(policy, current, load, 0.0, Trend(), held=held)
    need = min(policy.max, max(policy.min, math.ceil(load / policy.target_in_flight)))
    # Held requests are waiting, not served: no scale_up_after to wait for.
    assert decision.replicas == max(current, need) or decision.replicas == policy.max
    assert decision.replicas >= current
