"""A key's counts in one router's memory: right when one router serves the key."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from modelfleet.router.limits.base import Ticket, entry_name
from modelfleet.router.limits.window import WINDOW, Refusal, check, first_slice, slice_of

if TYPE_CHECKING:
    from modelfleet.router.table import ApiKey


@dataclass
class _Counts:
    requests: deque[float] = field(default_factory=deque)  # admission times, oldest first
    tokens: dict[int, int] = field(default_factory=dict)  # slice -> tokens
    in_flight: int = 0


class MemoryLimits:
    """The counts in this router's memory: requests exactly, tokens by slice."""

    def __init__(self) -> None:
        self._keys: dict[str, _Counts] = {}

    async def admit(
        self, key: ApiKey, tokens: int, request_id: str, now: float
    ) -> Ticket | Refusal:
        return self.admit_at_once(key, tokens, request_id, now)

    def admit_at_once(
        self, key: ApiKey, tokens: int, request_id: str, now: float
    ) -> Ticket | Refusal:
        counts = self._keys.setdefault(key.name, _Counts())
        while counts.requests and counts.requests[0] <= now - WINDOW:
            counts.requests.popleft()
        first = first_slice(now)
        for old in [s for s in counts.tokens if s < first]:
            del counts.tokens[old]
        refusal = check(key, counts.requests, {}, counts.tokens, counts.in_flight, tokens, now)
        if refusal is not None:
            return refusal
        here = slice_of(now)
        counts.requests.append(now)
        reserved = tokens if key.tpm is not None else 0
        if reserved:
            counts.tokens[here] = counts.tokens.get(here, 0) + reserved
        counts.in_flight += 1
        return Ticket(key.name, entry_name(request_id), reserved, here)

    async def settle(self, ticket: Ticket, tokens: int | None, now: float) -> None:
        self.settle_at_once(ticket, tokens, now)

    def settle_at_once(self, ticket: Ticket, tokens: int | None, now: float) -> bool:
        counts = self._keys.get(ticket.key)
        if counts is None:
            return True
        counts.in_flight = max(0, counts.in_flight - 1)
        if ticket.tokens and tokens is not None:
            back, more = settlement(ticket.tokens, tokens)
            if back and ticket.slice in counts.tokens:
                counts.tokens[ticket.slice] -= back
            if more:
                here = slice_of(now)
                counts.tokens[here] = counts.tokens.get(here, 0) + more
        if not (counts.requests or counts.tokens or counts.in_flight):
            del self._keys[ticket.key]  # nothing of it counts any more
        return True

    async def close(self) -> None:
        return None


def settlement(reserved: int, used: int) -> tuple[int, int]:
    """What a request's reservation becomes once its usage is known: the tokens that go back
    to the slice they were reserved in, and those it used beyond the reservation, which
    count now, when they were found used."""
    return max(0, reserved - used), max(0, used - reserved)
