"""The events of the fleet: what changed and what went wrong, kept in the store for `ctl
events`.

Shaped like Kubernetes events (type, reason, the object regarded, message, count with first
and last time), kept by count (`keep`, the oldest go first), never by age. An event that
repeats the last one about the same object (same reason and message) counts up instead of
adding one, so a router that misses every push for an hour is one line. Recording never
fails what it records: a store that cannot write loses the event, and says so in the log.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from modelfleet.store import Store, StoredEvent, StoreError

log = logging.getLogger("modelfleet.controlplane")

KEEP = 100_000
SOURCE = "control-plane"


class EventLog:
    """Records events into a store; `now` is the wall clock."""

    def __init__(
        self, store: Store, now: Callable[[], float], keep: int = KEEP, source: str = SOURCE
    ) -> None:
        self.store = store
        self.now = now
        self.keep = keep
        self.source = source  # which process saw it: with several control planes, which one
        self._last: dict[str, StoredEvent] = {}  # regarding -> the last event about it

    def normal(self, reason: str, regarding: str, message: str) -> None:
        self.record("normal", reason, regarding, message)

    def warning(self, reason: str, regarding: str, message: str) -> None:
        self.record("warning", reason, regarding, message)

    def record(self, kind: str, reason: str, regarding: str, message: str) -> None:
        at = self.now()
        # What an event quotes came from outside (a catalog's names): kept as UTF-8 can.
        regarding, message = _text(regarding), _text(message)
        last = self._last.get(regarding)
        try:
            if last is not None and (last.type, last.reason, last.message) == (
                kind,
                reason,
                message,
            ):
                again = dataclasses.replace(last, count=last.count + 1, last_at=at)
                self.store.repeat_event(last.id, again.count, at)
                self._last[regarding] = again
                return
            event = StoredEvent(0, kind, reason, regarding, message, 1, at, at, self.source)
            event_id = self.store.add_event(event, self.keep)
        except StoreError as exc:
            log.warning("event %s of %s not kept: %s", reason, regarding, exc)
            return
        self._last[regarding] = dataclasses.replace(event, id=event_id)


def _text(text: str) -> str:
    return text.encode("utf-8", "replace").decode("utf-8")
