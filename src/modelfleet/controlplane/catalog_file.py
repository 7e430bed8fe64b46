"""The catalog file, followed: applied whenever its content changes while this control plane
leads (a follower only says when it changed to a catalog the leader alone could apply); and
the event of each catalog applied or refused, from the file or the admin API."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from modelfleet.controlplane.catalogs import Applied, CatalogKeeper
from modelfleet.controlplane.config import ControlPlaneConfig
from modelfleet.controlplane.events import EventLog
from modelfleet.store import StoreError
from modelfleet.store.calls import StoreCalls

log = logging.getLogger("modelfleet.controlplane")


def applied_event(events: EventLog, applied: Applied, source: str) -> None:
    """The event of a catalog applied: its version, from where, what it changes."""
    if not applied.changed:
        return
    new, old = applied.catalog, applied.previous
    before = {m.name: m for m in old.models}
    after = {m.name: m for m in new.models}
    changed = sorted(name for name in after.keys() & before.keys() if after[name] != before[name])
    parts = [
        *(f"+{name}" for name in sorted(after.keys() - before.keys())),
        *(f"-{name}" for name in sorted(before.keys() - after.keys())),
        *(f"~{name}" for name in changed),
    ]
    changes = " ".join(parts) or "no model changed"
    events.normal("CatalogApplied", f"catalog/{new.version}", f"from {source}: {changes}")


def refused_event(events: EventLog, problems: Sequence[str], source: str) -> None:
    """The event of a catalog refused: its first three problems, and how many more."""
    shown = "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "")
    events.warning("CatalogRefused", "catalog/refused", f"from {source}: {shown}")


class CatalogFile:
    """The catalog file of one control plane (`config.catalog`), polled."""

    def __init__(
        self,
        catalogs: CatalogKeeper,
        calls: StoreCalls,
        events: EventLog,
        time: Callable[[], float],
        config: ControlPlaneConfig,
        acting: Callable[[], bool],
        wake: Callable[[], None],
    ) -> None:
        self.catalogs = catalogs
        self.calls = calls
        self.events = events
        self.time = time
        self.config = config
        self.acting = acting
        self.wake = wake
        self._said = ""  # the last error said, so that each is said once, not every poll

    async def run(self) -> None:
        """Apply the catalog file whenever its content changes, while leading; while
        following, say once when it changed to a catalog only the leader could apply."""
        while True:
            wait = self.config.catalog_poll_interval
            if self.catalogs.settling:  # a change read once: read again when it may have settled
                wait = min(wait, self.catalogs.settle_s)
            await asyncio.sleep(wait)
            if self.calls.outage is not None:
                continue  # read once the store answers again: nothing could be applied
            if self.acting():
                await self.check()
            else:
                await self.follow()

    async def follow(self) -> None:
        try:
            told = await self.calls(self.catalogs.follow_file, self.time())
        except (OSError, StoreError) as exc:
            told = f"cannot read the catalog file or the store's catalog: {exc}"
        if told is not None and told != self._said:
            self._said = told
            log.warning("%s", told)

    async def check(self) -> None:
        refused = self.catalogs.last_rejection()
        try:
            applied = await self.calls(self.catalogs.check_file, self.time())
            self._said = ""
        except (OSError, StoreError) as exc:
            if str(exc) != self._said:
                self._said = str(exc)
                what = "read the catalog file" if isinstance(exc, OSError) else "apply it"
                log.warning("cannot %s: %s; the current catalog stays", what, exc)
            return
        if applied is not None:
            applied_event(self.events, applied, str(self.config.catalog))
        rejection = self.catalogs.last_rejection()
        if rejection is not None and rejection != refused:
            refused_event(self.events, rejection.problems, rejection.source)
        if applied is not None and applied.changed:
            self.wake()
