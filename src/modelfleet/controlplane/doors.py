"""The control plane's doors that take a secret from anyone who reaches them: the join
exchange (a join token), the agent API (the agent token or a node's credential), and the
admin token, whether it is tried on the admin API or at the dashboard's sign-in (one throttle
for both: a guesser does not get twice the tries by using both). Failed tries are slowed down
per source address (`throttle.py`); a try made while its address waits is refused unheard
(429 with Retry-After), counted in `modelfleet_controlplane_throttled_total`, and not logged:
past the free failures an address gets at most one line per wait.

A try is counted as it arrives, before its secret is judged (`attempt`): a secret sent in a
body comes later, and tries whose heads all came first were otherwise all heard.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Literal

from modelfleet.controlplane.metrics import ControlPlaneMetrics
from modelfleet.core.throttle import Throttle, Verdict

log = logging.getLogger("modelfleet.controlplane")

Door = Literal["join", "sign-in", "admin", "agent"]
_TRIES: dict[Door, str] = {
    "join": "a join",
    "sign-in": "a sign-in",
    "admin": "an admin API request",
    "agent": "an agent API request",
}


class Doors:
    """One throttle per secret."""

    def __init__(self, metrics: ControlPlaneMetrics, monotonic: Callable[[], float]) -> None:
        self.metrics = metrics
        self.monotonic = monotonic
        admin_token = Throttle()
        self.throttles: dict[Door, Throttle] = {
            "join": Throttle(),
            "sign-in": admin_token,
            "admin": admin_token,
            "agent": Throttle(),
        }

    def attempt(self, door: Door, address: str) -> Verdict:
        """A try at `door` from `address`, as it arrives: refused unheard while its address
        waits (`wait` > 0, whole seconds to say in Retry-After: `retry_after`), or taken,
        counted as failed until `succeeded` is told."""
        verdict = self.throttles[door].attempt(address, self.monotonic())
        if verdict.wait > 0:
            self.metrics.throttled.labels(door).inc()
        return verdict

    def failed(self, door: Door, address: str, why: str, taken: Verdict) -> None:
        """The try `taken` (by `attempt`) from `address` failed: said in the log, at most
        once per wait of its address."""
        what = _TRIES[door]
        if taken.then <= 0:
            log.warning("refused %s from %s: %s", what, address, why)
            return
        meanwhile = (
            f"; {taken.refused_before} more tried meanwhile, refused unheard"
            if taken.refused_before
            else ""
        )
        log.warning(
            "refused %s from %s, failing again and again: %s%s; its next try is heard in %.0fs",
            what,
            address,
            why,
            meanwhile,
            taken.then,
        )

    def succeeded(self, door: Door, address: str) -> None:
        """The try from `address` held the secret: its address's failures are forgotten."""
        self.throttles[door].succeeded(address)

    def uncount(self, door: Door, address: str) -> None:
        """The try from `address` was refused for something other than its secret (which may
        not have been judged): not counted, and not taken for a success either."""
        self.throttles[door].uncount(address)


def retry_after(verdict: Verdict) -> str:
    """The Retry-After of a try refused unheard: whole seconds, rounded up."""
    return str(math.ceil(verdict.wait))
