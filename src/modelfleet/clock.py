"""The clock services read: a seam, so that tests move time instead of waiting for it."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Two readings: `monotonic` for intervals and deadlines, `time` (epoch seconds) for what
    is stored or shown as a date."""

    def monotonic(self) -> float: ...

    def time(self) -> float: ...


class SystemClock:
    """The machine's clocks."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


SYSTEM_CLOCK = SystemClock()
