"""The minute a key's limits count over, and whether one more request fits in it. Pure.

Requests per minute of a key counted exactly are the times of its requests: a request made
at `t` counts until `t + WINDOW`. Everything else (tokens, and the requests routers lease in
shares) is counted in slices of `SLICE` seconds: what was counted in a slice counts, whole,
until the slice has entirely left the last `WINDOW` seconds. So a count never misses
anything of the last minute: no 60 s window ever holds more than the limit. The price is
that a slice counts for up to `SLICE` seconds longer than a minute, so a client sending
steadily at exactly its limit sees up to `SLICE / WINDOW` (3 %) of its requests refused
early, none late.

The two-bucket estimate this replaced weighed the previous minute by how much of it was
still inside the window, assuming its requests were spread evenly: a client that sent its
whole limit at the end of one minute and again at the start of the next got nearly twice
its limit through in 60 s (1,980 of an rpm of 1,000, measured).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modelfleet.router.table import ApiKey

WINDOW = 60.0  # seconds: "per minute"
SLICE = 2.0  # seconds counted together
SLICES = round(WINDOW / SLICE)  # slices wholly inside a window: one more is partly inside


@dataclass(frozen=True)
class Refusal:
    """Why a request is over its key's limits, and when to try again."""

    limit: str  # "rpm", "tpm", "max_concurrent", or "store" (the store cannot be reached)
    allowed: int
    retry_after: float  # seconds
    why: str = ""  # for "store": what the store did (refused the connection, timed out, ...)

    @property
    def retry_after_s(self) -> int:
        """Whole seconds for `Retry-After`, at least 1 (a hair of float error is no second)."""
        return max(1, math.ceil(self.retry_after - 1e-6))

    def message(self, key: str, cost: int) -> str:
        what = {
            "store": "its limits store is unreachable",
            "rpm": f"{self.allowed} requests per minute",
            "tpm": f"{self.allowed} tokens per minute",
            "max_concurrent": f"{self.allowed} requests at once",
        }[self.limit]
        if self.limit == "tpm" and cost > self.allowed:
            return (
                f"This request may cost up to {cost} tokens (its prompt, and max_tokens for "
                f"each choice), more than the {what} of key '{key}' ever allows: lower "
                "max_tokens, n or the prompt."
            )
        return (
            f"Rate limit reached for key '{key}': {what} ({self.limit}). "
            f"Try again in {self.retry_after_s} s."
        )


def slice_of(now: float) -> int:
    """The slice `now` falls in."""
    return math.floor(now / SLICE)


def first_slice(now: float) -> int:
    """The oldest slice that still counts at `now`: it is at least partly inside the last
    `WINDOW` seconds."""
    return slice_of(now) - SLICES


def leaves_at(slice_: int) -> float:
    """When what was counted in `slice_` stops counting."""
    return (slice_ + 1) * SLICE + WINDOW


def live(slices: Mapping[int, int], now: float) -> dict[int, int]:
    """The slices of `slices` that still count at `now`."""
    first = first_slice(now)
    return {s: n for s, n in slices.items() if s >= first}


def wait_to_fit(
    leaving: Iterable[tuple[float, int]], counted: int, cost: int, limit: int, now: float
) -> float:
    """Seconds until `cost` more fits under `limit`, given what is `counted` now and when each
    part of it stops counting ((time, amount) pairs), if nothing else is counted meanwhile."""
    if counted + cost <= limit:
        return 0.0
    for at, amount in sorted(leaving):
        counted -= amount
        if counted + cost <= limit:
            return max(0.0, at - now)
    return WINDOW + SLICE  # more than the limit ever allows: say the longest wait there is


def check(
    key: ApiKey,
    request_times: Iterable[float],
    request_slices: Mapping[int, int],
    token_slices: Mapping[int, int],
    in_flight: int,
    cost: int,
    now: float,
) -> Refusal | None:
    """Which of `key`'s limits one more request of `cost` tokens is over, or None when it
    fits. The key's requests of the last minute are `request_times` (counted exactly) and
    `request_slices` (counted by slice); its tokens are `token_slices`; `in_flight` its
    requests under way. Of several limits it is over, the one it must wait longest for is
    named, so that its Retry-After holds for all."""
    refusals = []
    if key.tpm is not None and cost > key.tpm:
        return Refusal("tpm", key.tpm, WINDOW)  # never: the message says to ask for less
    if key.max_concurrent is not None and in_flight >= key.max_concurrent:
        refusals.append(Refusal("max_concurrent", key.max_concurrent, 1.0))
    if key.rpm is not None:
        leaving = [(t + WINDOW, 1) for t in request_times if t > now - WINDOW]
        leaving += [(leaves_at(s), n) for s, n in live(request_slices, now).items()]
        counted = sum(n for _, n in leaving)
        if counted + 1 > key.rpm:
            wait = wait_to_fit(leaving, counted, 1, key.rpm, now)
            refusals.append(Refusal("rpm", key.rpm, wait))
    if key.tpm is not None:
        tokens = live(token_slices, now)
        counted = sum(tokens.values())
        if counted + cost > key.tpm:
            leaving = [(leaves_at(s), n) for s, n in tokens.items()]
            wait = wait_to_fit(leaving, counted, cost, key.tpm, now)
            refusals.append(Refusal("tpm", key.tpm, wait))
    return max(refusals, key=lambda r: r.retry_after, default=None)
