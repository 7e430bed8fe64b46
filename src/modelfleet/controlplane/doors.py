"""The control plane's doors that take a secret from anyone who reaches them: the join
exchange (a join token) and the dashboard's sign-in (the admin token). Failed tries are
slowed down per source address (`throttle.py`); a try made while its address waits is
refused unheard (429 with Retry-After), counted in `modelfleet_controlplane_throttled_total`,
and not logged: past the free failures an address gets at most one line per wait.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

from modelfleet.controlplane.metrics import ControlPlaneMetrics
from modelfleet.core.throttle import Throttle

log = logging.getLogger("modelfleet.controlplane")

Door = Literal["join", "sign-in"]


class Doors:
    """One throttle per door."""

    def __init__(self, metrics: ControlPlaneMetrics, monotonic: Callable[[], float]) -> None:
        self.metrics = metrics
        self.monotonic = monotonic
        self.throttles: dict[Door, Throttle] = {"join": Throttle(), "sign-in": Throttle()}

    def wait(self, door: Door, address: str) -> float:
        """Seconds until a try at `door` from `address` is heard; 0: it is heard now."""
        verdict = self.throttles[door].check(address, self.monotonic())
        if verdict.wait > 0:
            self.metrics.throttled.labels(door).inc()
        return verdict.wait

    def failed(self, door: Door, address: str, why: str) -> None:
        """A try from `address` failed: said in the log, and its next waits (past the free)."""
        verdict = self.throttles[door].failed(address, self.monotonic())
        if verdict.wait <= 0:
            log.warning("refused a %s from %s: %s", door, address, why)
            return
        meanwhile = (
            f"; {verdict.refused_before} more tried meanwhile, refused unheard"
            if verdict.refused_before
            else ""
        )
        log.warning(
            "refused a %s from %s, failing again and again: %s%s; its next try is heard in %.0fs",
            door,
            address,
            why,
            meanwhile,
            verdict.wait,
        )

    def succeeded(self, door: Door, address: str) -> None:
        self.throttles[door].succeeded(address)
