"""Which replica a request goes to: load, failures and prefixes, with no I/O and no clock.

The router counts the requests it has in flight at each endpoint, and learns every few moments
how many requests each engine holds in all (running and waiting, from the engine's metrics,
which counts other routers' requests too). The load of an endpoint is the larger of the two:
the engine's count already holds this router's requests, so a sum would count them twice, and
this router's own count is the fresher while it is the only one sending.

- **Least load**: power of two choices. Two endpoints drawn at random, the less loaded one
  taken: as good as the least loaded in practice, without every router herding onto the
  same replica between two scrapes.
- **Prefix**: consistent hashing with bounded load. A prompt's leading characters hash to a
  point on a ring of endpoints; the first endpoint clockwise whose load stays within a bound
  of the least loaded takes it (at most `prefix_slack` requests more, or `prefix_factor`
  times as many), so prompts that share a prefix meet the engine that has cached it, until
  that engine is busier than the rest by more than the bound.
- **Ejection**: an endpoint that fails `eject_after` times in a row is taken out for a while
  (doubling with each ejection in a row, up to a cap). When its time is up it waits for a
  probe (`probe_due`, `probed`): only a healthy answer brings it back.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache


@dataclass
class EndpointState:
    """What the balancer knows of one endpoint."""

    in_flight: int = 0  # this router's requests to it now
    engine_load: int = 0  # running + waiting at its engine, as last scraped
    failures: int = 0  # in a row
    ejections: int = 0  # in a row, without a success between
    ejected_until: float | None = None  # set while ejected; past it, a probe is due
    ejected_why: str = ""  # while ejected: the failure that took it out, or its failed probe

    @property
    def load(self) -> int:
        return max(self.in_flight, self.engine_load)


@dataclass(frozen=True)
class BalancerSettings:
    eject_after: int = 3  # failures in a row
    eject_for: float = 5.0  # seconds, first ejection
    eject_max: float = 60.0  # seconds, at most
    # Prefix routing: an endpoint takes a prefix's request while its load is at most the
    # least load plus `prefix_slack`, or `prefix_factor` times the least load.
    prefix_slack: int = 4
    prefix_factor: float = 1.5
    vnodes: int = 64  # points per endpoint on the prefix ring


class Balancer:
    """The choice of endpoint for each request, and the counts it is made from."""

    def __init__(self, settings: BalancerSettings | None = None, rng: random.Random | None = None):
        self.settings = settings or BalancerSettings()
        self.state: dict[str, EndpointState] = {}
        self._rng = rng or random.Random()

    def _of(self, endpoint: str) -> EndpointState:
        state = self.state.get(endpoint)
        if state is None:
            state = self.state[endpoint] = EndpointState()
        return state

    def usable(self, endpoint: str) -> bool:
        """Whether requests may go to `endpoint`: not ejected, nor waiting for its probe."""
        state = self.state.get(endpoint)
        return state is None or state.ejected_until is None

    def pick(
        self,
        endpoints: Sequence[str],
        *,
        exclude: Collection[str] = (),
        prefix: bytes | None = None,
    ) -> str | None:
        """The endpoint for the next request among `endpoints`, or None when every one is
        ejected or excluded (already tried by this request)."""
        state = self.state
        candidates = [
            e
            for e in endpoints
            if e not in exclude and ((s := state.get(e)) is None or s.ejected_until is None)
        ]
        n = len(candidates)
        if n <= 1:
            return candidates[0] if candidates else None
        if prefix is not None:
            return self._by_prefix(candidates, prefix)
        # Two distinct candidates at random (random.sample costs several times more).
        i = int(self._rng.random() * n)
        j = int(self._rng.random() * (n - 1))
        a, b = candidates[i], candidates[j + 1 if j >= i else j]
        return a if self._load(a) <= self._load(b) else b

    def _load(self, endpoint: str) -> int:
        state = self.state.get(endpoint)
        return state.load if state else 0

    def _by_prefix(self, candidates: list[str], prefix: bytes) -> str:
        loads = {e: self._load(e) for e in candidates}
        least = min(loads.values())
        s = self.settings
        bound = max(least + s.prefix_slack, math.floor(least * s.prefix_factor))
        points, owners = _ring(tuple(sorted(candidates)), self.settings.vnodes)
        start = bisect.bisect(points, _hash(prefix))
        seen: set[str] = set()
        for i in range(len(points)):
            owner = owners[(start + i) % len(points)]
            if owner in seen:
                continue
            if loads[owner] <= bound:
                return owner
            seen.add(owner)
            if len(seen) == len(candidates):
                break
        return min(candidates, key=loads.__getitem__)  # not reached: the least is in bound

    # -- what happened ------------------------------------------------------------------

    def in_flight(self) -> dict[str, int]:
        """This router's requests in flight, by endpoint."""
        return {endpoint: state.in_flight for endpoint, state in self.state.items()}

    def begin(self, endpoint: str) -> None:
        self._of(endpoint).in_flight += 1

    def end(self, endpoint: str) -> None:
        state = self._of(endpoint)
        state.in_flight = max(0, state.in_flight - 1)

    def succeeded(self, endpoint: str) -> None:
        state = self.state.get(endpoint)
        if state is not None:
            state.failures = 0
            state.ejections = 0

    def failed(self, endpoint: str, now: float, why: str = "") -> bool:
        """Count a failure of `endpoint` (no connection, a 502/503/504, a timeout: `why`);
        returns whether this one ejected it."""
        state = self._of(endpoint)
        if state.ejected_until is not None:
            return False
        state.failures += 1
        if state.failures < self.settings.eject_after:
            return False
        return self.eject(endpoint, now, f"{state.failures} failures in a row, the last: {why}")

    def eject(self, endpoint: str, now: float, why: str = "") -> bool:
        """Take `endpoint` out now (its engine does not answer at all: `why`); returns
        whether it was in."""
        state = self._of(endpoint)
        if state.ejected_until is not None:
            return False
        s = self.settings
        state.ejected_until = now + min(s.eject_max, s.eject_for * 2**state.ejections)
        state.ejected_why = why
        state.ejections += 1
        state.failures = 0
        return True

    def probe_due(self, now: float) -> list[str]:
        """Ejected endpoints whose time is up: each waits for a health probe."""
        return [
            e
            for e, s in self.state.items()
            if s.ejected_until is not None and now >= s.ejected_until
        ]

    def probed(self, endpoint: str, healthy: bool, now: float) -> None:
        """The answer of `endpoint`'s probe: healthy brings it back, otherwise it stays out
        for another (longer) while."""
        state = self.state.get(endpoint)
        if state is None or state.ejected_until is None:
            return
        if healthy:
            state.ejected_until = None
            state.ejected_why = ""
        else:
            s = self.settings
            state.ejected_until = now + min(s.eject_max, s.eject_for * 2**state.ejections)
            state.ejected_why = "its health probe got no healthy answer"
            state.ejections += 1

    def set_engine_load(self, endpoint: str, load: int) -> None:
        self._of(endpoint).engine_load = max(0, load)

    def keep_only(self, endpoints: Iterable[str]) -> None:
        """Forget endpoints no longer in the table, except those with requests in flight."""
        keep = set(endpoints)
        for endpoint in [e for e, s in self.state.items() if e not in keep and not s.in_flight]:
            del self.state[endpoint]


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@lru_cache(maxsize=256)
def _ring(endpoints: tuple[str, ...], vnodes: int) -> tuple[list[int], list[str]]:
    """The hash ring of `endpoints`: sorted points and the endpoint owning each."""
    pairs = sorted((_hash(f"{e}#{i}".encode()), e) for e in endpoints for i in range(vnodes))
    return [p for p, _ in pairs], [e for _, e in pairs]
