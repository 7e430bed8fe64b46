"""`up` as a service manager: a process of the fleet that dies is started again."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from modelfleet.core.backoff import Backoff
from modelfleet.host.processes import log_tail
from modelfleet.up.children import Child, UpError, exited
from modelfleet.up.fleet import RunningFleet

# A process started again and not ready this long after is said to be slow (still starting,
# with what its log says last: what it waits for), once; it is followed until it is ready.
SLOW_AFTER_S = 15.0


@dataclass
class Restarts:
    """A process of the fleet that dies is started again: at once the first time, then after
    a delay that doubles (1 s, 2 s, ... to 30 s) while it keeps dying within 30 s of its
    start. An agent's engines are not restarted: they outlive it, and the new agent adopts
    them.

    A process started again is not waited for: each `tend` looks whether it is ready (said
    once it is), still starting (said once, when slow: SLOW_AFTER_S), or exited (said with
    its exit and its log's last lines, and started again after the backoff)."""

    backoff: Backoff = field(
        default_factory=lambda: Backoff(base=1.0, cap=30.0, reset_after=30.0, first_at_once=True)
    )
    failures: dict[int, int] = field(default_factory=dict)  # id(child) -> deaths in a row
    due: dict[int, float] = field(default_factory=dict)  # id(child) -> when to restart it
    # id(child) -> whether it was said to be slow: the children started again, not yet ready
    coming: dict[int, bool] = field(default_factory=dict)

    def tend(self, fleet: RunningFleet, stopping: Callable[[], bool], now: float) -> bool:
        """Restart what died and is due at `now` (monotonic), and follow what was restarted
        until it is ready. True when the processes running changed (one exited, started or
        came up): `up.json` is written again, never keeping a pid that is gone."""
        changed = False
        for c in fleet.fleet.children:
            if stopping():
                break
            key = id(c)
            if key in self.coming:
                changed |= self._follow(fleet, c, now)
            if key in self.coming or c.proc.poll() is None:
                continue
            where = f" on {c.node}" if c.node else ""
            if key not in self.due:
                failures = self.backoff.failures(self.failures.get(key, 0), now - c.started_at)
                self.failures[key] = failures
                delay = self.backoff.delay(failures)
                self.due[key] = now + delay
                print(
                    f"warning: {c.role}{where} {exited(c, 10)}\nrestarting it in {delay:.0f}s",
                    flush=True,
                )
                changed = True
            if now < self.due[key]:
                continue
            del self.due[key]
            fleet.fleet.relaunch(c)
            self.coming[key] = False
            changed = True
        return changed

    def _follow(self, fleet: RunningFleet, c: Child, now: float) -> bool:
        """Whether `c`, started again, is ready (then said, and True), exited (True: `tend`
        says how), or still starting (said once it is slow)."""
        key = id(c)
        where = f" on {c.node}" if c.node else ""
        try:
            ready = fleet.fleet.ready(c)
        except UpError:
            del self.coming[key]  # exited before it was ready: `tend` says so
            return True
        took = now - c.started_at
        if ready is not None:
            del self.coming[key]
            if c.role == "agent" and c.node:
                fleet.agent_admin[c.node] = ready["urls"]["admin"]
            print(
                f"{c.role}{where} restarted: pid {c.proc.pid}, ready after {took:.0f}s", flush=True
            )
            return True
        if not self.coming[key] and took >= SLOW_AFTER_S:
            self.coming[key] = True
            last = log_tail(c.log, 1)
            says = f"its log's last line: {last[0]}" if last else f"{c.log} is empty so far"
            print(
                f"note: {c.role}{where} (pid {c.proc.pid}) is still starting after "
                f"{took:.0f}s, not failed: {says} (said again once it is ready)",
                flush=True,
            )
        return False
