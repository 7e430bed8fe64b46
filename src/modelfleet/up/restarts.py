"""`up` as a service manager: a process of the fleet that dies is started again."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from modelfleet.core.backoff import Backoff
from modelfleet.up.children import UpError
from modelfleet.up.fleet import RunningFleet


@dataclass
class Restarts:
    """A process of the fleet that dies is started again: at once the first time, then after
    a delay that doubles (1 s, 2 s, ... to 30 s) while it keeps dying within 30 s of its
    start. An agent's engines are not restarted: they outlive it, and the new agent adopts
    them."""

    backoff: Backoff = field(
        default_factory=lambda: Backoff(base=1.0, cap=30.0, reset_after=30.0, first_at_once=True)
    )
    failures: dict[int, int] = field(default_factory=dict)  # id(child) -> deaths in a row
    due: dict[int, float] = field(default_factory=dict)  # id(child) -> when to restart it

    def tend(self, fleet: RunningFleet, stopping: Callable[[], bool], now: float) -> bool:
        """Restart what died and is due at `now` (monotonic); True when anything was."""
        restarted = False
        for c in fleet.fleet.children:
            if c.proc.poll() is None or stopping():
                continue
            key = id(c)
            where = f" on {c.node}" if c.node else ""
            if key not in self.due:
                failures = self.backoff.failures(self.failures.get(key, 0), now - c.started_at)
                self.failures[key] = failures
                delay = self.backoff.delay(failures)
                self.due[key] = now + delay
                print(
                    f"warning: {c.role}{where} exited with code {c.proc.returncode}; "
                    f"restarting it in {delay:.0f}s (log: {c.log})",
                    flush=True,
                )
            if now < self.due[key]:
                continue
            del self.due[key]
            try:
                ready = fleet.fleet.restart(c)
            except UpError as exc:
                print(f"warning: {c.role}{where} did not come back: {exc}", flush=True)
                continue
            if c.role == "agent" and c.node:
                fleet.agent_admin[c.node] = ready["urls"]["admin"]
            print(f"{c.role}{where} restarted: pid {c.proc.pid}", flush=True)
            restarted = True
        return restarted
