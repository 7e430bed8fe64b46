"""Keys' limits shared by every router that names the same Redis server: a key's limit is
the same whatever the number of routers. Keys with large limits are leased (`leases.py`),
the others counted one request at a time (`exact.py`); both count in the same Redis keys, so
a key whose limits change from one kind to the other keeps its counts.

When Redis cannot be reached, or does not answer within `store.TIMEOUT` (and after a few
such the breaker opens), a request of a key with limits is refused with 503 naming why (the
default: with two routers failing open, a key of rpm 100 was served 220 requests in a minute
while Redis answered slowly), or goes through unlimited where the operator chose
`limits_fail: open`; either way it is logged, once per `log_every` seconds. In the
background, every second, the router probes an unreachable server, and every `RENEW_EVERY`
seconds it moves on the deadlines of the slots it holds and tries again the settlements that
failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from modelfleet.router.limits.base import Ticket
from modelfleet.router.limits.exact import RENEW_EVERY, ExactCounts
from modelfleet.router.limits.leases import Leases, leased
from modelfleet.router.limits.store import (
    PROBE_EVERY,
    LimitsStore,
    StoreUnavailable,
    client_for,
)
from modelfleet.router.limits.window import Refusal

if TYPE_CHECKING:
    import redis.asyncio

    from modelfleet.router.table import ApiKey

log = logging.getLogger("modelfleet.router")


class RedisLimits:
    """The counts in Redis, shared by routers. `now` passed in is the router's wall clock."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        fail_open: bool = False,
        prefix: str = "modelfleet:limits:",
        log_every: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sync_clock: bool = True,
    ) -> None:
        self.store = LimitsStore(client, prefix, clock, wall, sync_clock)
        self.name = f"router-{random.getrandbits(64):016x}"  # the holder of its slots
        self.exact = ExactCounts(self.store)
        self.leases = Leases(self.store, self.name)
        self.fail_open = fail_open
        self.log_every = log_every
        self.clock = clock
        self.wall = wall
        self._logged = -math.inf
        self.store_failures = 0  # requests admitted or refused without the store
        self._tending: asyncio.Task[None] | None = None

    @classmethod
    def from_url(cls, url: str, fail_open: bool = False, sync_clock: bool = True) -> RedisLimits:
        return cls(client_for(url), fail_open, sync_clock=sync_clock)

    @property
    def client(self) -> redis.asyncio.Redis:
        return self.store.client

    @property
    def prefix(self) -> str:
        return self.store.prefix

    @prefix.setter
    def prefix(self, prefix: str) -> None:
        self.store.prefix = prefix

    async def admit(
        self, key: ApiKey, tokens: int, request_id: str, now: float
    ) -> Ticket | Refusal:
        self._tend()
        at = self.store.time(now)
        try:
            if leased(key):
                return await self.leases.admit(key, tokens, at)
            return await self.exact.admit(key, tokens, request_id, at)
        except StoreUnavailable as exc:
            return self._unbacked(key, request_id, exc)

    def admit_at_once(
        self, key: ApiKey, tokens: int, request_id: str, now: float
    ) -> Ticket | Refusal | None:
        if self.store.breaker.open:
            return self._unbacked(key, request_id, StoreUnavailable("taken as unreachable"))
        if not leased(key):
            return None  # one script per request
        self._tend()
        return self.leases.admit_at_once(key, tokens, self.store.time(now))

    def settle_at_once(self, ticket: Ticket, tokens: int | None, now: float) -> bool:
        if not ticket.backed:
            return True
        if ticket.leased:
            self.leases.settle(ticket, tokens, self.store.time(now))
            return True
        return False

    async def settle(self, ticket: Ticket, tokens: int | None, now: float) -> None:
        """Settle; settlements that come while a round trip is under way go together in the
        next. One that fails is tried again (see `exact.py`)."""
        if not ticket.backed:
            return
        if ticket.leased:
            self.leases.settle(ticket, tokens, self.store.time(now))
            await self.leases.given()  # what it gave back is counted
            return
        await asyncio.shield(self.exact.settle(ticket, tokens, self.store.time(now)))

    def _unbacked(self, key: ApiKey, request_id: str, exc: Exception) -> Ticket | Refusal:
        self.store_failures += 1
        action = "letting requests through unlimited" if self.fail_open else "refusing them"
        self._log(f"the limits store is unreachable ({exc}); {action}")
        if self.fail_open:
            return Ticket(key.name, request_id, 0, 0, backed=False)
        return Refusal("store", 0, 1.0, why=str(exc))

    def _log(self, message: str) -> None:
        now = self.clock()
        if now - self._logged >= self.log_every:
            self._logged = now
            log.warning("%s", message)

    def _tend(self) -> None:
        """Start the background work once there is a loop to run it on."""
        if self._tending is None:
            self._tending = asyncio.ensure_future(self._tend_forever())

    async def _tend_forever(self) -> None:
        renewed = self.clock()
        while True:
            await asyncio.sleep(PROBE_EVERY)
            if self.store.breaker.open:
                await self.store.probe()
                continue
            if self.clock() - renewed < RENEW_EVERY:
                continue
            renewed = self.clock()
            await self.renew()

    async def renew(self) -> None:
        """Move on the deadlines of what this router holds; try failed settlements again."""
        at = self.store.time(self.wall())
        with contextlib.suppress(StoreUnavailable):
            await self.exact.renew(at)
            await self.leases.renew(at)

    async def close(self) -> None:
        """Give back what this router holds, for at most 2 s, then close."""
        if self._tending is not None:
            self._tending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tending
        with contextlib.suppress(StoreUnavailable, TimeoutError):
            async with asyncio.timeout(2):
                await self.leases.close()
                await self.exact.release_all()
        await self.store.client.aclose()
