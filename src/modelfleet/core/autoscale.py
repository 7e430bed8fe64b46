"""How many replicas a model that follows its load should have now. Pure: the caller passes
the load and `now`, and keeps the `Trend` this returns for the next call.

The load is what the replicas are asked to carry: the routers' requests in flight plus the
engines' own waiting queues, summed over routers. Per replica it is compared with the
policy's `target_in_flight`:

- **Up** once the load per replica has stayed over the target for `scale_up_after`: at once
  to as many replicas as bring it to the target or under (not one at a time), up to `max`.
  A *burst*, a load of `BURST` times the target or more, goes up once it has lasted
  `BURST_WAIT` of `scale_up_after`: its replicas' engines queue what they cannot run, so each
  second waited is a second late on every first token, while a load that far over the target
  is not one that was just under it a moment ago (Knative's "panic" mode answers the same).
  A model at zero replicas with any load goes up at once, without waiting: its requests are
  being held. So does one whose routers hold requests (`held`: none of its replicas serves
  yet, or those that do are at their target): they are waiting, not being served.
- **Down** one replica at a time, only when one fewer would still carry the load under
  `DOWN_MARGIN` of the target (a margin, so that a load just under the target does not go
  down and straight up again), and only once that has held for `scale_down_after` without a
  break, counted again after every step down: a load that rises within that time cancels it,
  so a square wave faster than `scale_down_after` never takes a replica away.
- **To zero** when the policy's `min` is 0 and the load has been nothing at all for
  `scale_to_zero_after`, from however many replicas it has then (stepping down one at a
  time first took `scale_down_after` per replica, past the time the operator set).

Never under `floor` (what a drain in progress needs), never outside [`min`, `max`].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

DOWN_MARGIN = 0.7  # one fewer replica must carry the load under this share of the target
BURST = 2.0  # a load per replica of this many times the target is a burst
BURST_WAIT = 0.5  # a burst goes up after this share of `scale_up_after`


@dataclass(frozen=True)
class Policy:
    """A model's `autoscale` bounds and timers (seconds)."""

    min: int
    max: int
    target_in_flight: float
    scale_up_after: float = 2.0
    scale_down_after: float = 300.0
    scale_to_zero_after: float = 600.0


@dataclass(frozen=True)
class Trend:
    """Since when the load has been over the target, a burst, low enough to go down, and
    nothing; None while it is not."""

    over_since: float | None = None
    burst_since: float | None = None
    low_since: float | None = None
    idle_since: float | None = None


@dataclass(frozen=True)
class Decision:
    """The replicas the model should have, why (with the numbers), and the trend to pass to
    the next call."""

    replicas: int
    reason: str
    trend: Trend

    def changed(self, current: int) -> bool:
        return self.replicas != current


def decide(
    policy: Policy,
    current: int,
    load: float,
    now: float,
    trend: Trend,
    floor: int = 0,
    held: float = 0.0,
) -> Decision:
    """The replicas a model with `current` replicas carrying `load` (of which `held` are
    requests routers hold) should have at `now`."""
    least = max(policy.min, min(floor, policy.max))
    target = policy.target_in_flight
    need = min(policy.max, max(least, math.ceil(load / target)))
    level = pressure(load, current, target)
    low = current > 1 and load / (current - 1) < DOWN_MARGIN * target
    trend = Trend(
        over_since=_since(trend.over_since, now) if level >= OVER else None,
        burst_since=_since(trend.burst_since, now) if level >= BURST_LEVEL else None,
        low_since=_since(trend.low_since, now) if low else None,
        idle_since=_since(trend.idle_since, now) if load <= 0 else None,
    )
    over_for = _for(trend.over_since, now)
    burst_for = _for(trend.burst_since, now)
    low_for = _for(trend.low_since, now)
    idle_for = _for(trend.idle_since, now)
    numbers = f"load {load:g} on {current} replica(s), target {target:g} each"
    if current < least:
        up = max(least, need) if held > 0 else least  # held requests wait: all they need
        return Decision(up, f"up to the least allowed ({least}): {numbers}", trend)
    if current > policy.max:
        return Decision(policy.max, f"down to the most allowed ({policy.max}): {numbers}", trend)
    if current == 0 and load > 0:
        return Decision(max(1, need), f"up from zero, requests waiting: {numbers}", Trend())
    if held > 0 and need > current:
        why = f"up at once: {held:g} request(s) held: {numbers}"
        return Decision(need, why, replace(trend, over_since=None, burst_since=None))
    burst = burst_for >= BURST_WAIT * policy.scale_up_after
    if current < policy.max and (burst or over_for >= policy.scale_up_after):
        if burst:
            why = f"a burst, {load / current / target:.1f}x the target for {burst_for:.1f}s"
        else:
            why = f"over the target for {over_for:.1f}s"
        restart = replace(trend, over_since=None, burst_since=None)
        return Decision(max(need, current + 1), f"up: {why}: {numbers}", restart)
    if current >= 1 and least == 0 and idle_for >= policy.scale_to_zero_after:
        return Decision(0, f"to zero: no load for {idle_for:.0f}s", trend)
    if current > max(least, 1) and low_for >= policy.scale_down_after:
        why = f"down by one: low for {low_for:.0f}s: {numbers}"
        return Decision(current - 1, why, replace(trend, low_since=now))
    return Decision(current, f"steady: {numbers}", trend)


OVER, BURST_LEVEL = 1, 2


def pressure(load: float, replicas: int, target: float) -> int:
    """How far `load` on `replicas` is over `target` each: 0 not over (or no replica),
    `OVER`, or `BURST_LEVEL` at `BURST` times the target or more."""
    if replicas <= 0 or load <= target * replicas:
        return 0
    return BURST_LEVEL if load >= BURST * target * replicas else OVER


def up_due(policy: Policy, trend: Trend) -> float | None:
    """When `trend`, if it goes on, makes a scale-up due: the earlier of the time over the
    target reaching `scale_up_after` and a burst reaching its share of it; None if neither
    is under way."""
    due = []
    if trend.over_since is not None:
        due.append(trend.over_since + policy.scale_up_after)
    if trend.burst_since is not None:
        due.append(trend.burst_since + BURST_WAIT * policy.scale_up_after)
    return min(due, default=None)


def _since(since: float | None, now: float) -> float:
    return now if since is None else since


def _for(since: float | None, now: float) -> float:
    """How long a condition has held: -inf while it does not."""
    return -math.inf if since is None else now - since
