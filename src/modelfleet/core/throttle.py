"""Failed tries per source address, slowed down: for doors that take a secret from anyone who
reaches them (the join exchange, the dashboard's sign-in, the admin and agent tokens).

An address may fail `free` times in a row; after that each try waits for a delay that
doubles with every failure (`base`, 2 x `base`, ... up to `cap`), and a try made during it is
refused without its secret being looked at. A success forgets the address, and so does
`forget_after` seconds without a try. At most `max_addresses` are remembered (the oldest
forgotten first), so that a flood from many addresses costs bounded memory. Pure: the caller
passes `now`.

A door whose secret comes after the try has begun (in a body) counts the try as it arrives
(`attempt`): failed until `succeeded` says otherwise. Judged only once its body came, 300
sign-ins whose heads were sent first and bodies later were all heard before the first failed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class _Tries:
    failures: int = 0
    last: float = 0.0  # when the last failure was
    refused: int = 0  # tries refused while it waited, since the address was last said


@dataclass(frozen=True)
class Verdict:
    """What to do with a try: `wait` seconds until one is taken (0: take this one)."""

    wait: float
    refused_before: int = 0  # tries refused since this address was last said (for the log)
    then: float = 0.0  # of a try taken by `attempt`: the next one's wait, if this one fails


@dataclass
class Throttle:
    """Failed tries per source address, and how long each must wait now."""

    free: int = 3
    base: float = 1.0
    cap: float = 60.0
    forget_after: float = 600.0
    max_addresses: int = 10_000
    _seen: OrderedDict[str, _Tries] = field(default_factory=OrderedDict)

    def check(self, address: str, now: float) -> Verdict:
        """Whether a try from `address` is taken now; one that is not is counted."""
        tries = self._current(address, now)
        if tries is None or tries.failures < self.free:
            return Verdict(0.0)
        due = tries.last + self.delay(tries.failures)
        if now >= due:
            return Verdict(0.0)
        tries.refused += 1
        return Verdict(due - now, tries.refused)

    def failed(self, address: str, now: float) -> Verdict:
        """A try from `address` failed: how long its next one waits, and the tries refused
        since the last failure (for one log line per failure past the free ones)."""
        tries = self._current(address, now) or _Tries()
        tries.failures += 1
        tries.last = now
        refused, tries.refused = tries.refused, 0
        self._seen[address] = tries
        self._seen.move_to_end(address)
        while len(self._seen) > self.max_addresses:
            self._seen.popitem(last=False)
        wait = self.delay(tries.failures) if tries.failures >= self.free else 0.0
        return Verdict(wait, refused)

    def attempt(self, address: str, now: float) -> Verdict:
        """A try from `address` as it arrives, before its secret is judged: refused (`wait`
        > 0, counted as `check` counts), or taken and counted as a failure at once, which
        `succeeded` forgets when its secret is right."""
        verdict = self.check(address, now)
        if verdict.wait > 0:
            return verdict
        failed = self.failed(address, now)
        return Verdict(0.0, failed.refused_before, then=failed.wait)

    def uncount(self, address: str) -> None:
        """A try taken by `attempt` was no guess after all (its secret was right, and
        something else refused it): no longer counted, and the address's other failures
        still are."""
        tries = self._seen.get(address)
        if tries is not None:
            tries.failures -= 1
            if tries.failures <= 0:
                del self._seen[address]

    def succeeded(self, address: str) -> None:
        self._seen.pop(address, None)

    def delay(self, failures: int) -> float:
        """The wait after `failures` in a row (0 for the free ones)."""
        if failures < self.free:
            return 0.0
        return min(self.cap, self.base * 2.0 ** (failures - self.free))

    def _current(self, address: str, now: float) -> _Tries | None:
        tries = self._seen.get(address)
        if tries is not None and now - tries.last > self.forget_after:
            del self._seen[address]
            return None
        return tries
