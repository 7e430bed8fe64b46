"""The events of the fleet: what changed and what went wrong, kept in the store for `ctl
events`.

Shaped like Kubernetes events (type, reason, the object regarded, message, count with first
and last time), kept by count (`keep`, the oldest go first), never by age. An event that
repeats the last one about the same object (same reason and message) counts up instead of
adding one, so a router that misses every push for an hour is one line.

Recording never waits for the store and never fails what it records: an event is noted in
memory and written by `flush`, which the control plane runs off its event loop every
`FLUSH_S` (`run`). While the store cannot write, events wait (up to `MAX_PENDING`, the
oldest dropped past it, and said once); they are written, in order, once it can.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import operator
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from modelfleet.core.fleet import replica_id_stem
from modelfleet.store import (
    EventScope,
    EventWrite,
    Fenced,
    Store,
    StoredEvent,
    StoreError,
    StoreUnreachable,
)

log = logging.getLogger("modelfleet.controlplane")

KEEP = 100_000
SOURCE = "control-plane"
MAX_PENDING = 10_000
FLUSH_S = 0.1
FLUSH_MOST = 500  # events one transaction writes at most: each store call is short


@dataclass
class _Entry:
    """An event as noted: `id` once written; `dirty` while the store lacks its last count."""

    event: StoredEvent
    fenced: bool
    id: int | None = None
    dirty: bool = True


class EventLog:
    """Notes events and writes them into a store; `now` is the wall clock."""

    def __init__(
        self, store: Store, now: Callable[[], float], keep: int = KEEP, source: str = SOURCE
    ) -> None:
        self.store = store
        self.now = now
        self.keep = keep
        self.source = source  # which process saw it: with several control planes, which one
        self._last: dict[str, _Entry] = {}  # regarding -> the last event about it
        self._pending: list[_Entry] = []  # in the order they happened
        self._lock = threading.Lock()  # `flush` runs in a worker thread
        self._flushing = threading.Lock()  # one flush at a time, so that they keep the order
        self._wanted = asyncio.Event()
        self.dropped = 0  # events lost to MAX_PENDING while the store could not write
        self._failure = ""

    def normal(self, reason: str, regarding: str, message: str) -> None:
        self.record("normal", reason, regarding, message)

    def warning(self, reason: str, regarding: str, message: str, fenced: bool = True) -> None:
        self.record("warning", reason, regarding, message, fenced)

    def record(
        self, kind: str, reason: str, regarding: str, message: str, fenced: bool = True
    ) -> None:
        """Note an event, to be written at the next flush. Not `fenced`: written whoever
        leads by then (a leader saying it lost the lease)."""
        at = self.now()
        # What an event quotes came from outside (a catalog's names): kept as UTF-8 can.
        regarding, message = _text(regarding), _text(message)
        with self._lock:
            last = self._last.get(regarding)
            if last is not None and (last.event.type, last.event.reason, last.event.message) == (
                kind,
                reason,
                message,
            ):
                last.event = dataclasses.replace(last.event, count=last.event.count + 1, last_at=at)
                if not last.dirty:
                    last.dirty = True
                    self._pending.append(last)
            else:
                event = StoredEvent(0, kind, reason, regarding, message, 1, at, at, self.source)
                entry = _Entry(event, fenced)
                self._last[regarding] = entry
                self._pending.append(entry)
            if len(self._pending) > MAX_PENDING:
                gone = len(self._pending) - MAX_PENDING
                for old in self._pending[:gone]:
                    old.dirty = False
                del self._pending[:gone]
                self.dropped += gone
        self._wanted.set()

    def flush(self, most: int | None = None) -> None:
        """Write the events noted and not yet written, in order, in transactions of up to
        FLUSH_MOST (in a worker thread, or where no event loop runs: tests), `most` at most.
        Stops at the first batch the store refuses, logging it once per cause; what is left
        is tried again at the next flush."""
        with self._flushing:
            left = math.inf if most is None else most
            while left > 0:
                with self._lock:
                    if not self._pending:
                        return
                    head = self._pending[: int(min(left, FLUSH_MOST))]
                    fenced = head[0].fenced
                    batch = [*itertools.takewhile(operator.attrgetter("fenced"), head)]
                    if not fenced:
                        batch = [*itertools.takewhile(lambda e: not e.fenced, head)]
                    writes = [EventWrite(e.event, e.id) for e in batch]
                left -= len(batch)
                try:
                    ids = self.store.write_events(writes, self.keep, fenced)
                except Fenced:
                    self._settle(batch, None)  # of a term that ended: never written
                    continue
                except StoreUnreachable:
                    raise  # the caller's outage says it; swallowed, it read as an answer
                except StoreError as exc:
                    if str(exc) != self._failure:
                        self._failure = str(exc)
                        log.warning("events wait to be written: %s", exc)
                    return
                self._failure = ""
                self._settle(batch, [(w.event, i) for w, i in zip(writes, ids, strict=True)])

    def _settle(self, batch: list[_Entry], written: list[tuple[StoredEvent, int]] | None) -> None:
        """Take `batch` out of what waits, as `written` (event as written, its id), or as
        dropped when None; one that happened again meanwhile waits on to be counted up."""
        with self._lock:
            done = set()
            for n, entry in enumerate(batch):
                if written is not None:
                    event, entry.id = written[n]
                    if entry.event != event:
                        continue
                entry.dirty = False
                done.add(id(entry))
            self._pending = [e for e in self._pending if id(e) not in done]

    async def run(self, call: Callable[[Callable[[], None]], Awaitable[None]]) -> None:
        """Flush through `call` (which runs it off the event loop) whenever events are noted,
        at most every FLUSH_S, until cancelled."""
        said = 0
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            with contextlib.suppress(StoreError):  # said by flush or by the outage: tried again
                await call(functools.partial(self.flush, FLUSH_MOST))  # one transaction
            if self.dropped > said:
                log.warning(
                    "%d event(s) were dropped: more than %d waited to be written (the store "
                    "could not write them, or not as fast as they came)",
                    self.dropped - said,
                    MAX_PENDING,
                )
                said = self.dropped
            if self._pending:
                self._wanted.set()
            await asyncio.sleep(FLUSH_S)


def event_scope(regarding: str | None) -> str | EventScope | None:
    """What a filter on `regarding` reads (`ctl events --for`, the events page, a node's
    page): a model's events with those of its replicas and their shards; a node's with those
    of the shards it runs or ran (a shard's events regard its replica); anything else as it
    says (one object, or a kind)."""
    if regarding is None or "/" not in regarding:
        return regarding
    kind, name = regarding.split("/", 1)
    if kind == "model":
        return EventScope((regarding,), families=(f"replica/{replica_id_stem(name)}-",))
    if kind == "node":
        return EventScope((regarding,), shards_on=name)
    return regarding


def _text(text: str) -> str:
    return text.encode("utf-8", "replace").decode("utf-8")
