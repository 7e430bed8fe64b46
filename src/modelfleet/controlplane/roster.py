"""The roster: the nodes that hold replicas, kept in the store by the leader, so that the next
term (here after a restart, or on another control plane after a failover) settles until they
have reported instead of until a timer a busy loop may outrun."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable

from modelfleet.controlplane.term import Term
from modelfleet.store import Store, StoreError
from modelfleet.store.calls import StoreCalls

log = logging.getLogger("modelfleet.controlplane")

ROSTER_KEY = "roster"  # in the store's meta
ROSTER_EVERY_S = 5.0  # kept at most this often


def read_roster(store: Store) -> frozenset[str] | None:
    """The roster the term before kept (store I/O: off the event loop); None when none was."""
    roster = store.get_meta(ROSTER_KEY)
    return None if roster is None else frozenset(json.loads(roster))


class Roster:
    """The roster as this control plane last stored it, and when."""

    def __init__(self, calls: StoreCalls, store: Store, monotonic: Callable[[], float]) -> None:
        self.calls = calls
        self.store = store
        self.monotonic = monotonic
        self._stored: tuple[frozenset[str] | None, float] = (None, -math.inf)

    def began(self, roster: frozenset[str] | None) -> None:
        """A term began with `roster` as the store held it."""
        self._stored = (roster, self.monotonic())

    async def keep(self, term: Term) -> None:
        """Keep `term`'s roster in the store (at most every ROSTER_EVERY_S, and never while
        settling, when what is known is partial)."""
        now = self.monotonic()
        stored, at = self._stored
        if term.settling(now) or now - at < ROSTER_EVERY_S:
            return
        roster = term.roster_now(now)
        if roster == stored:
            return
        try:
            await self.calls(self.store.set_meta, ROSTER_KEY, json.dumps(sorted(roster)))
        except StoreError as exc:
            log.debug("cannot keep the roster yet: %s", exc)
            return
        self._stored = (roster, now)
