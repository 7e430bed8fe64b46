"""How long to wait before starting again something that keeps failing.

Pure: the agent (for engines) and `up` (for the fleet's own processes) both count failures in
a row with it and ask it for the next delay. The delay doubles per failure in a row up to a
cap; something that ran for `reset_after` seconds before it failed starts the count over.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Delays `base`, 2 x `base`, 4 x `base` ... up to `cap`; with `first_at_once`, the first
    failure of a row restarts at once and the doubling begins at the second."""

    base: float
    cap: float
    reset_after: float
    first_at_once: bool = False

    def failures(self, before: int, ran_for: float) -> int:
        """The failures in a row after one more, given how long the failed run lasted."""
        return 1 if ran_for >= self.reset_after else before + 1

    def delay(self, failures: int) -> float:
        """Seconds to wait before the next start, after `failures` (>= 1) failures in a row."""
        steps = failures - 1 - (1 if self.first_at_once else 0)
        if steps < 0:
            return 0.0
        return min(self.cap, self.base * 2.0**steps)
