"""The clock services read: a seam, so that tests move time instead of waiting for it."""

from __future__ import annotations

import asyncio
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


async def wait_set(event: asyncio.Event, seconds: float) -> bool:
    """Wait until `event` is set, `seconds` at most: whether it was.

    Not `asyncio.wait_for(event.wait(), seconds)`: on Python 3.11, a task cancelled in the
    same turn of the event loop as the event is set comes back from that wait as if nothing
    happened, so a service loop built on it runs on and its stop waits for it for ever."""
    if event.is_set():
        # Still one turn of the loop, as `wait_for` gave: a service loop whose every pass sets
        # its own event must not keep the others from running.
        await asyncio.sleep(0)
        return True
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return False
    return True
