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
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from modelfleet.store import Fenced, Store, StoredEvent, StoreError

log = logging.getLogger("modelfleet.controlplane")

KEEP = 100_000
SOURCE = "control-plane"
MAX_PENDING = 10_000
FLUSH_S = 0.1
FLUSH_MOST = 200  # events one flush writes at most: each store call is short


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
        """Write the events noted and not yet written, in order, `most` of them at most (in a
        worker thread, or where no event loop runs: tests). Stops at the first the store
        refuses, logging it once per cause; those left are tried again at the next flush."""
        with self._flushing:
            for _ in itertools.repeat(None) if most is None else range(most):
                with self._lock:
                    if not self._pending:
                        return
                    entry = self._pending[0]
                    event, written = entry.event, entry.id
                try:
                    if written is None:
                        new = self.store.add_event(event, self.keep, entry.fenced)
                    else:
                        self.store.repeat_event(written, event.count, event.last_at, entry.fenced)
                        new = written
                except Fenced:
                    self._drop_first(entry)  # of a term that ended: never written
                    continue
                except StoreError as exc:
                    if str(exc) != self._failure:
                        self._failure = str(exc)
                        log.warning("events wait to be written: %s", exc)
                    return
                self._failure = ""
                with self._lock:
                    entry.id = new
                    if entry.event == event and self._pending and self._pending[0] is entry:
                        entry.dirty = False
                        self._pending.pop(0)

    def _drop_first(self, entry: _Entry) -> None:
        with self._lock:
            if self._pending and self._pending[0] is entry:
                self._pending.pop(0)
                entry.dirty = False

    async def run(self, call: Callable[[Callable[[], None]], Awaitable[None]]) -> None:
        """Flush through `call` (which runs it off the event loop) whenever events are noted,
        at most every FLUSH_S, until cancelled."""
        said = 0
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            with contextlib.suppress(StoreError):  # said by flush or by the outage: tried again
                await call(functools.partial(self.flush, FLUSH_MOST))
            if self.dropped > said:
                log.warning(
                    "%d event(s) were dropped while the store could not write", self.dropped - said
                )
                said = self.dropped
            if self._pending:
                self._wanted.set()
            await asyncio.sleep(FLUSH_S)


def _text(text: str) -> str:
    return text.encode("utf-8", "replace").decode("utf-8")
