"""Keys with small limits, counted in Redis one request at a time: one script admits (checks
every limit of the key, then counts), one settles. Admissions that arrive while a round trip
is under way go together in the next, as one pipeline; so do settlements.

A request counted in flight is held in Redis until a deadline `SLOT_TTL` seconds ahead,
which its router moves on every `RENEW_EVERY` seconds while the request runs (putting it
back if Redis lost it in a restart). A router that dies stops moving it: its requests stop
counting at most `SLOT_TTL` seconds later (they were held an hour). A settlement that fails
is tried again at the next renewal, until its deadline has passed anyway; a settlement that
never arrives frees its slot at the deadline. The store gives a reservation's tokens back
once, however often its settlement is sent (a timeout does not say it did not run). An
admission that timed out is settled as unused when the store answers again: it may have run.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from modelfleet.router.limits.base import Ticket, entry_name
from modelfleet.router.limits.memory import settlement
from modelfleet.router.limits.store import LimitsStore, StoreUnavailable
from modelfleet.router.limits.window import Refusal, check, slice_of

if TYPE_CHECKING:
    from modelfleet.router.table import ApiKey

log = logging.getLogger("modelfleet.router")

SLOT_TTL = 30.0  # seconds a request in flight stays counted after its router last said so
RENEW_EVERY = 10.0  # seconds between a router's renewals of what it holds


class ExactCounts:
    """Admits and settles requests of keys counted one request at a time."""

    def __init__(self, store: LimitsStore) -> None:
        self.store = store
        self._admitting: list[tuple[list[str], list[Any], asyncio.Future[Any]]] = []
        self._admit_flusher: asyncio.Future[None] | None = None
        # Settlements not yet confirmed by the store: (keys, args, deadline).
        self._settling: list[tuple[list[str], list[Any], float]] = []
        self._settle_flusher: asyncio.Future[None] | None = None
        # Requests of this router in flight, whose deadlines it moves on: admission -> key.
        self.held: dict[str, str] = {}

    async def admit(
        self, key: ApiKey, tokens: int, request_id: str, now: float
    ) -> Ticket | Refusal:
        """Admit one request; `now` on Redis' clock. Raises StoreUnavailable."""
        entry = entry_name(request_id)
        args = [
            repr(now), key.rpm or 0, key.tpm or 0, key.max_concurrent or 0, tokens, entry,
            repr(now + SLOT_TTL),
        ]  # fmt: skip
        answer = await self._batched(self.store.keys(key.name), args)
        if answer[0] == 1:
            if key.max_concurrent is not None:
                self.held[entry] = key.name
            reserved = tokens if key.tpm is not None else 0
            return Ticket(key.name, entry, reserved, slice_of(now))
        times = [float(t) for t in answer[1][1::2]]
        refusal = check(
            key, times, slices_of(answer[2]), slices_of(answer[3]), int(answer[4]), tokens, now
        )
        # The script refused on the same counts, so `check` names a limit; were the two ever
        # to disagree, the request is still refused, as the store decided.
        return refusal or Refusal("rpm", key.rpm or 0, 1.0)

    async def _batched(self, keys: list[str], args: list[Any]) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._admitting.append((keys, args, future))
        if self._admit_flusher is None or self._admit_flusher.done():
            self._admit_flusher = asyncio.ensure_future(self._flush_admissions())
        return await future

    async def _flush_admissions(self) -> None:
        store = self.store
        while self._admitting:
            # An admission whose client left before it was sent is not sent.
            batch = [item for item in self._admitting if not item[2].done()]
            self._admitting = []
            if not batch:
                continue
            try:
                if len(batch) == 1:
                    keys, args, _ = batch[0]
                    results: list[Any] = [await store.script(store.admit, keys, args)]
                else:
                    results = await store.pipelined([(store.admit, k, a) for k, a, _ in batch])
            except StoreUnavailable as exc:
                for keys, args, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                    if exc.sent:
                        # It timed out, yet may run when the store catches up: its slot and
                        # tokens go back at the next renewal (once at most), not now, while
                        # the store is failing.
                        self._unadmit(keys, args, at_once=False)
                continue
            for (keys, args, future), result in zip(batch, results, strict=True):
                if future.done():
                    # Its client left while the store counted it: what was counted for it in
                    # flight and of tokens goes back at once, not when its slot lapses.
                    if not isinstance(result, Exception) and result[0] == 1:
                        self._unadmit(keys, args)
                    continue
                if isinstance(result, Exception):
                    future.set_exception(StoreUnavailable(str(result)))
                else:
                    future.set_result(result)

    def settle(self, ticket: Ticket, tokens: int | None, now: float) -> asyncio.Future[None]:
        """Settle in the background (`now` on Redis' clock); returns the round trip that
        carries it, for whoever wants to wait for it."""
        self.held.pop(ticket.entry, None)
        back, more = settlement(ticket.tokens, tokens) if tokens is not None else (0, 0)
        args = [ticket.slice, back, slice_of(now), more, ticket.entry]
        flusher = self._queue_settlement(self.store.keys(ticket.key), args, now)
        assert flusher is not None
        return flusher

    def _unadmit(self, keys: list[str], args: list[Any], at_once: bool = True) -> None:
        """Settle an admission the store made, or may have made, for a request no engine will
        see (its client left, or the router refused it when the store answered too late):
        its tokens all go back, if they were counted, and its slot is freed."""
        now, tpm, tokens, entry = float(args[0]), args[2], args[4], args[5]
        here = slice_of(now)
        self._queue_settlement(keys, [here, tokens if tpm else 0, here, 0, entry], now, at_once)

    def _queue_settlement(
        self, keys: list[str], args: list[Any], now: float, at_once: bool = True
    ) -> asyncio.Future[None] | None:
        self._settling.append(([keys[2], keys[3], keys[6]], args, now + SLOT_TTL))
        if not at_once:
            return None
        if self._settle_flusher is None or self._settle_flusher.done():
            self._settle_flusher = asyncio.ensure_future(self._flush_settlements(now))
        return self._settle_flusher

    async def _flush_settlements(self, now: float) -> None:
        store = self.store
        while self._settling:
            batch, self._settling = self._settling, []
            try:
                answers = await store.pipelined([(store.settle, k, a) for k, a, _ in batch])
            except StoreUnavailable as exc:
                answers = [exc] * len(batch)
            failed = [
                item
                for item, answer in zip(batch, answers, strict=True)
                if isinstance(answer, Exception) and item[2] > now
            ]
            if failed:
                # Kept for the next renewal; past its deadline a slot frees itself.
                self._settling[:0] = failed
                log.warning("%d settlement(s) failed; tried again shortly", len(failed))
                return

    async def renew(self, now: float) -> None:
        """Move on the deadlines of this router's requests in flight, and try again the
        settlements that failed (`now` on Redis' clock). Raises StoreUnavailable."""
        if self._settling and (self._settle_flusher is None or self._settle_flusher.done()):
            self._settle_flusher = asyncio.ensure_future(self._flush_settlements(now))
        if not self.held:
            return
        deadline = now + SLOT_TTL
        held = list(self.held.items())

        async def work() -> None:
            pipe = self.store.client.pipeline(transaction=False)
            for entry, name in held:
                # Added back if the store lost it (Redis restarted): other routers see it.
                in_flight = self.store.keys(name)[3]
                pipe.zadd(in_flight, {entry: deadline})
                pipe.expire(in_flight, int(SLOT_TTL) + 1)
            await pipe.execute()

        await self.store.call(work)

    async def release_all(self) -> None:
        """This router stops: its requests still in flight stop counting at once."""
        held, self.held = list(self.held.items()), {}
        if not held:
            return

        async def work() -> None:
            pipe = self.store.client.pipeline(transaction=False)
            for entry, name in held:
                pipe.zrem(self.store.keys(name)[3], entry)
            await pipe.execute()

        await self.store.call(work)


def slices_of(flat: Sequence[Any]) -> dict[int, int]:
    """A script's slice -> count list, [slice, count, slice, count, ...], as a mapping."""
    return {int(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}
