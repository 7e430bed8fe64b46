"""What every place a router counts keys' limits in answers: a ticket for each admitted
request, settled when it ends, or a refusal saying which limit and when to try again."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from modelfleet.router.limits.window import Refusal

if TYPE_CHECKING:
    from modelfleet.router.table import ApiKey


@dataclass
class Ticket:
    """An admitted request: what it counted, to be settled when it ends."""

    key: str
    entry: str  # the admission's own name in the store; for a leased one, its router's name
    tokens: int  # reserved
    slice: int  # the slice its tokens were counted in
    backed: bool = True  # False: admitted without the store (fail open); nothing to settle
    leased: bool = False  # admitted from a lease (`Leases`)
    grant: Any = None  # for a leased one: the share of the lease its tokens came from


class Limits(Protocol):
    """Where a router counts its keys' requests and tokens. `now` is the router's wall
    clock: a store shared by routers corrects it to the store's own clock."""

    async def admit(
        self, key: ApiKey, tokens: int, request_id: str, now: float
    ) -> Ticket | Refusal: ...

    def admit_at_once(
        self, key: ApiKey, tokens: int, request_id: str, now: float
    ) -> Ticket | Refusal | None:
        """Admit without waiting when no round trip is needed (in memory, from a lease);
        None when `admit` must be awaited instead."""
        ...

    async def settle(self, ticket: Ticket, tokens: int | None, now: float) -> None:
        """The request ended: `tokens` it used (None: unknown, the reservation stands)."""
        ...

    def settle_at_once(self, ticket: Ticket, tokens: int | None, now: float) -> bool:
        """Settle without waiting when no round trip is needed (in memory, into a lease);
        False when `settle` must be awaited instead."""
        ...

    async def close(self) -> None: ...


def entry_name(request_id: str) -> str:
    """A name for one admission, unique even when clients reuse their x-request-id."""
    return f"{request_id[:64]}/{random.getrandbits(64):016x}"
