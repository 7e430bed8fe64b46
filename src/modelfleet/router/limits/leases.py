"""Keys with large limits: each router leases a share of a key's allowance from Redis and
admits from it in memory, so that most requests never wait for Redis.

A round trip to Redis per request doubled the router's added latency and CPU (1,000 limited
keys in `bench/router.py`), so a key whose every rate limit (`rpm`, `tpm`) is at least
`LEASED_FROM` a minute is leased instead. A router asks for at most 1/`LEASE_SHARE` of each
limit at a time (or what the request needs, when that is more), and asks again in the
background once half of it is used: a key in steady use never waits for its lease.

The store counts a grant as used at the moment it grants it, in that moment's slice, and a
slice counts in every window it overlaps. So a grant can be used only until its slice ends: a
request admitted from it then lies in the slice, and every 60 s window that holds the request
holds the slice too, so no window ever holds more than the limit. What is left of a grant
when its slice ends goes back to the store. (Grants were usable for `WINDOW` seconds once: a
request admitted late in one lay in windows that no longer counted its slice, and a property
test found 232 admitted against an rpm of 231.) What routers hold unused can refuse a request
early, by up to a share and a half per router; it never lets one more through. Unused tokens
of an ended request go back to the grant they came from; tokens used beyond a reservation are
counted in the store when they are found.

Requests in flight are leased as slots: a router keeps at most one share of unused slots
(none under 100 requests at once, which is then exact) and gives the rest back as requests
end. A router says every `RENEW_EVERY` seconds how many it holds; one that stops (it died)
has its slots freed `SLOT_TTL` seconds later. If the store forgot them meanwhile (Redis
restarted, or the router could not reach it past its deadline), the renewal counts them again
at once, so that the other routers see those requests: a lapsed slot lease once let the
routers' total reach 1,500 against a limit of 1,000.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modelfleet.router.limits.base import Ticket
from modelfleet.router.limits.exact import SLOT_TTL, slices_of
from modelfleet.router.limits.memory import settlement
from modelfleet.router.limits.store import LimitsStore, StoreUnavailable
from modelfleet.router.limits.window import SLICE, WINDOW, Refusal, check, slice_of

if TYPE_CHECKING:
    from modelfleet.router.table import ApiKey

log = logging.getLogger("modelfleet.router")

LEASE_SHARE = 100  # a router leases at most 1/LEASE_SHARE of a key's limit at a time
LEASED_FROM = 2 * LEASE_SHARE  # rpm and tpm from which a key is leased
# Scripts per pipeline for renewals and give-backs: building and reading a pipeline of a
# thousand scripts held the event loop for about 30 ms, during which every request waited.
BATCH = 25


def share(limit: int | None) -> int:
    """A router's share of `limit` (0: none, or under `LEASE_SHARE`)."""
    return 0 if limit is None else limit // LEASE_SHARE


def leased(key: ApiKey) -> bool:
    """Whether `key`'s limits are leased by routers rather than counted per request."""
    return (key.rpm is None or key.rpm >= LEASED_FROM) and (
        key.tpm is None or key.tpm >= LEASED_FROM
    )


def _limits(key: ApiKey) -> tuple[int | None, int | None, int | None]:
    return key.rpm, key.tpm, key.max_concurrent


@dataclass
class Grant:
    """Requests and tokens the store granted a router, counted in `slice`; usable until
    `expires` (on Redis' clock)."""

    slice: int
    expires: float
    requests: int
    tokens: int


@dataclass
class _Lease:
    """What one router holds of one key."""

    key: ApiKey | None = None  # the key as last seen, with its limits
    grants: deque[Grant] = field(default_factory=deque)  # oldest first
    slots: int = 0  # requests in flight it may have
    in_flight: int = 0
    slot_share: int = 0  # unused slots it keeps
    fetching: asyncio.Future[Refusal | None] | None = None  # a grant asked for, unanswered
    used_at: float = -math.inf

    def prune(self, now: float) -> list[Grant]:
        """Drop the grants whose slice has ended; returns them."""
        lapsed = []
        while self.grants and self.grants[0].expires <= now:
            lapsed.append(self.grants.popleft())
        return lapsed

    def left(self) -> tuple[int, int]:
        """Requests and tokens it can still admit."""
        return sum(g.requests for g in self.grants), sum(g.tokens for g in self.grants)


class Leases:
    """This router's leases of every leased key. Times are on Redis' clock."""

    def __init__(self, store: LimitsStore, name: str) -> None:
        self.store = store
        self.name = name  # the holder of this router's slots
        self._leases: dict[str, _Lease] = {}
        self._giving: list[tuple[list[str], list[Any]]] = []
        self._give_flusher: asyncio.Future[None] | None = None
        # What lapsed grants leave unused: given back on their own, never waited for by a
        # grant (that only frees room; waiting for it held requests for up to 88 ms when a
        # thousand keys' grants lapsed every slice, bench/router.py).
        self._lapsed: list[tuple[list[str], list[Any]]] = []
        self._lapse_flusher: asyncio.Future[None] | None = None
        self.leases_taken = 0  # round trips for grants: a figure for tests and the benchmark

    def lease_of(self, key: ApiKey) -> _Lease:
        lease = self._leases.get(key.name)
        if lease is None:
            lease = self._leases[key.name] = _Lease()
        elif lease.key is not None and _limits(lease.key) != _limits(key):
            self._drop(key.name, lease)  # leased under other limits: they hold no more
        lease.key = key
        lease.slot_share = share(key.max_concurrent)
        return lease

    def admit_at_once(self, key: ApiKey, tokens: int, now: float) -> Ticket | Refusal | None:
        """Admit from the lease with no round trip, or None: `admit` must wait for one."""
        if key.tpm is not None and tokens > key.tpm:
            return Refusal("tpm", key.tpm, WINDOW)
        lease = self.lease_of(key)
        got = self._take(key, lease, tokens, now)
        return got if isinstance(got, Ticket) else None

    async def admit(self, key: ApiKey, tokens: int, now: float) -> Ticket | Refusal:
        """Admit from the lease, asking the store for more only when it falls short. Raises
        StoreUnavailable."""
        if key.tpm is not None and tokens > key.tpm:
            return Refusal("tpm", key.tpm, WINDOW)
        lease = self.lease_of(key)
        while True:
            got = self._take(key, lease, tokens, now)
            if isinstance(got, Ticket):
                return got
            fetching = lease.fetching
            mine = fetching is None
            if fetching is None:
                # A task of its own, so that a grant is recorded even when the request that
                # asked for it is cancelled meanwhile (its client gone).
                fetching = self._fetch_in_background(key, lease, got, tokens, now)
            try:
                refusal = await asyncio.shield(fetching)
            except asyncio.CancelledError:
                # Its client left: slots granted for it go back once the grant is in (after
                # any request woken by the same grant has taken what it needs).
                fetching.add_done_callback(self._trim_soon(key.name, lease, now))
                raise
            if refusal is not None and mine:
                return refusal
            # A grant came (or another request's was refused): look again.

    def _take(
        self, key: ApiKey, lease: _Lease, tokens: int, now: float
    ) -> Ticket | tuple[int, int, int]:
        """Admit from what `lease` holds, or say what it is short of: requests, tokens,
        slots."""
        self._lapse(key.name, lease, now)
        need_r = 1 if key.rpm is not None else 0
        need_t = tokens if key.tpm is not None else 0
        have_r, have_t = lease.left()
        short_r, short_t = max(0, need_r - have_r), max(0, need_t - have_t)
        short_s = max(0, lease.in_flight + 1 - lease.slots) if key.max_concurrent else 0
        if short_r or short_t or short_s:
            return short_r, short_t, short_s
        source: Grant | None = None  # the oldest grant its tokens come from
        for grant in lease.grants:
            if need_r and grant.requests:
                grant.requests -= 1
                need_r = 0
            if need_t and grant.tokens:
                took = min(need_t, grant.tokens)
                grant.tokens -= took
                need_t -= took
                source = source or grant
            if not (need_r or need_t):
                break
        lease.in_flight += 1
        lease.used_at = now
        self._prefetch(key, lease, now)
        reserved = tokens if key.tpm is not None else 0
        where = source.slice if source is not None else slice_of(now)
        return Ticket(key.name, self.name, reserved, where, leased=True, grant=source)

    def _prefetch(self, key: ApiKey, lease: _Lease, now: float) -> None:
        """Ask for the next share in the background once half of this one is used."""
        if lease.fetching is not None:
            return
        have_r, have_t = lease.left()
        low_r = key.rpm is not None and have_r <= share(key.rpm) // 2
        low_t = key.tpm is not None and have_t <= share(key.tpm) // 2
        if low_r or low_t:
            shorts = (1 if key.rpm is not None else 0, 1 if key.tpm is not None else 0, 0)
            self._fetch_in_background(key, lease, shorts, 0, now)

    def _fetch_in_background(
        self, key: ApiKey, lease: _Lease, shorts: tuple[int, int, int], tokens: int, now: float
    ) -> asyncio.Future[Refusal | None]:
        fetching = asyncio.ensure_future(self._fetch(key, lease, shorts, tokens, now))
        lease.fetching = fetching
        fetching.add_done_callback(_retrieved)
        return fetching

    async def _fetch(
        self, key: ApiKey, lease: _Lease, shorts: tuple[int, int, int], tokens: int, now: float
    ) -> Refusal | None:
        """Lease what `shorts` says is missing (requests, tokens, slots), at least a share of
        each; record what is granted. Returns why the store refused, or None."""
        short_r, short_t, short_s = shorts
        store = self.store
        try:
            await self.given()  # what this router gives back counts before what it asks for
            args = [
                repr(now), key.rpm or 0, key.tpm or 0, key.max_concurrent or 0,
                max(short_r, share(key.rpm)) if short_r else 0, short_r,
                max(short_t, share(key.tpm)) if short_t else 0, short_t,
                max(short_s, lease.slot_share) if short_s else 0, short_s,
                self.name, repr(now + SLOT_TTL),
            ]  # fmt: skip
            answer = await store.script(store.lease, store.keys(key.name), args)
        finally:
            lease.fetching = None
        self.leases_taken += 1
        granted_r, granted_t, granted_s, refused = (int(v) for v in answer[:4])
        if refused:
            times = [float(t) for t in answer[4][1::2]]
            found = check(
                key, times, slices_of(answer[5]), slices_of(answer[6]), int(answer[7]), tokens, now
            )
            limit = {1: "rpm", 2: "tpm", 3: "max_concurrent"}[refused]
            if found is not None and found.limit == limit:
                return found
            allowed = {"rpm": key.rpm, "tpm": key.tpm}.get(limit, key.max_concurrent)
            return Refusal(limit, allowed or 0, 1.0)
        if granted_r or granted_t:
            here = slice_of(now)
            lease.grants.append(Grant(here, (here + 1) * SLICE, granted_r, granted_t))
        lease.slots += granted_s
        return None

    def settle(self, ticket: Ticket, tokens: int | None, now: float) -> None:
        """A leased request ended: its slot and its unused tokens go back to the lease."""
        back, more = settlement(ticket.tokens, tokens) if tokens is not None else (0, 0)
        lease = self._leases.get(ticket.key)
        if lease is None or ticket.entry != self.name:
            # Another router's ticket (only tests settle one here): straight to the store.
            self._give(ticket.key, ticket.slice, 0, back, 1, holder=ticket.entry)
            if more:
                self._give(ticket.key, slice_of(now), 0, -more, 0)
            return
        lease.in_flight = max(0, lease.in_flight - 1)
        if back:
            if any(g is ticket.grant for g in lease.grants):
                ticket.grant.tokens += back
            else:  # its grant lapsed: what is left of its slice in the store frees room
                self._give(ticket.key, ticket.slice, 0, back, 0)
        if more:
            self._give(ticket.key, slice_of(now), 0, -more, 0)
        self._trim(ticket.key, lease, now)

    def _trim_soon(
        self, name: str, lease: _Lease, now: float
    ) -> Callable[[asyncio.Future[Any]], None]:
        """A grant's callback that trims `lease` once the requests it woke have run."""

        def trim(fetched: asyncio.Future[Any]) -> None:
            fetched.get_loop().call_soon(self._trim, name, lease, now)

        return trim

    def _trim(self, name: str, lease: _Lease, now: float) -> None:
        """Give back the slots `lease` holds beyond its requests in flight and its share."""
        keep = lease.in_flight + lease.slot_share
        if lease.slots > keep:
            self._give(name, slice_of(now), 0, 0, lease.slots - keep)
            lease.slots = keep

    def _lapse(self, name: str, lease: _Lease, now: float) -> None:
        """Drop the grants whose slice has ended; what they hold unused goes back to the
        store, which stops counting it."""
        for grant in lease.prune(now):
            if grant.requests or grant.tokens:
                keys = self.store.keys(name)
                args = [grant.slice, grant.requests, grant.tokens, 0, self.name]
                self._lapsed.append(([keys[1], keys[2], keys[4]], args))
        if self._lapsed and (self._lapse_flusher is None or self._lapse_flusher.done()):
            self._lapse_flusher = asyncio.ensure_future(self._flush(self._lapsed))

    def _drop(self, name: str, lease: _Lease) -> None:
        """Give back what is left of every grant, and the slots of no request in flight."""
        for grant in lease.grants:
            if grant.requests or grant.tokens:
                self._give(name, grant.slice, grant.requests, grant.tokens, 0)
        lease.grants.clear()
        surplus = max(0, lease.slots - lease.in_flight)
        if surplus:
            self._give(name, 0, 0, 0, surplus)
            lease.slots -= surplus

    def _give(
        self, name: str, slice_: int, requests: int, tokens: int, slots: int, holder: str = ""
    ) -> None:
        """Give back to the store (negative tokens: add), in the background: gives that come
        while one round trip is under way go together in the next, one pipeline."""
        keys = self.store.keys(name)
        args = [slice_, requests, tokens, slots, holder or self.name]
        self._giving.append(([keys[1], keys[2], keys[4]], args))
        if self._give_flusher is None or self._give_flusher.done():
            self._give_flusher = asyncio.ensure_future(self._flush(self._giving))

    async def _flush(self, queue: list[tuple[list[str], list[Any]]]) -> None:
        """Send what `queue` holds to the store, a pipeline of up to BATCH at a time, until
        it is empty."""
        store = self.store
        while queue:
            batch = queue[:BATCH]
            del queue[:BATCH]
            try:
                await store.pipelined([(store.give, keys, args) for keys, args in batch])
            except StoreUnavailable as exc:
                # Tokens and requests not given back count until their slice leaves; slots
                # are set right by the next renewal.
                log.warning("cannot give back %d lease(s) to the limits store: %s", len(batch), exc)

    async def renew(self, now: float) -> None:
        """Say how many slots this router holds of each key (its deadline moves on), give
        back the slots of keys unused for a minute, and forget leases that hold nothing.
        Raises StoreUnavailable."""
        renewing: list[tuple[str, _Lease]] = []
        for name, lease in list(self._leases.items()):
            self._lapse(name, lease, now)
            idle = lease.in_flight == 0 and lease.fetching is None
            if idle and lease.used_at < now - WINDOW:
                if lease.slots:
                    self._give(name, 0, 0, 0, lease.slots)
                    lease.slots = 0
                if not lease.grants:
                    del self._leases[name]
                    continue
            if lease.slots:
                renewing.append((name, lease))
        store = self.store
        for start in range(0, len(renewing), BATCH):
            batch = renewing[start : start + BATCH]
            calls = []
            for name, lease in batch:
                keys = store.keys(name)
                # While a grant or a give-back is under way the count it holds is moving:
                # only its deadline moves on.
                moving = lease.fetching is not None or self._gives_under_way()
                held = -1 if moving else lease.slots
                calls.append(
                    (store.renew_slots, [keys[4], keys[5]], [self.name, held, now + SLOT_TTL, now])
                )
            answers = await store.pipelined(calls)
            for (name, lease), answer in zip(batch, answers, strict=True):
                if answer == 0 and lease.slots:
                    log.warning(
                        "the limits store had forgotten the %d slot(s) of key %s this router "
                        "holds (Redis restarted?): counted again",
                        lease.slots,
                        name,
                    )

    async def given(self) -> None:
        """Wait until what was given back so far has reached the store."""
        flusher = self._give_flusher
        if flusher is not None and not flusher.done():
            await asyncio.shield(flusher)

    def _gives_under_way(self) -> bool:
        flusher = self._give_flusher
        return bool(self._giving) or (flusher is not None and not flusher.done())

    async def close(self) -> None:
        """Give back everything this router holds (for at most 2 s)."""
        for name, lease in self._leases.items():
            self._drop(name, lease)
            if lease.slots:
                self._give(name, 0, 0, 0, lease.slots)
                lease.slots = 0
        flushers = [f for f in (self._give_flusher, self._lapse_flusher) if f is not None]
        if flushers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(asyncio.gather(*flushers)), 2)


def _retrieved(future: asyncio.Future[Any]) -> None:
    """A background grant's failure is seen by whoever awaits it, or by nobody: not logged
    as never retrieved."""
    if not future.cancelled():
        future.exception()
