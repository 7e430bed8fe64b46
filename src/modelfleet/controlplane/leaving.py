"""Replicas on their way out of service, make-before-break: retiring ones (stopped by the
plan, a drain, a deleted node) and those put to sleep (`idle_action: sleep`). Both leave the
routing table at once; a retiring one is let go (dropped from its nodes' assignments, so its
agent stops the engine, which finishes what is in flight) and a sleeping one's agent is told
to sleep it, once every router holds a table without it, or at its deadline. Pure."""

from __future__ import annotations

from typing import Protocol

from modelfleet.controlplane.changes import Changes
from modelfleet.controlplane.records import ReplicaRecord


class Table(Protocol):
    """What leaving replicas read and change of the control plane's memory (`FleetState`)."""

    @property
    def replicas(self) -> dict[str, ReplicaRecord]: ...

    @property
    def changes(self) -> Changes: ...

    @property
    def retired(self) -> dict[str, tuple[str, float]]: ...

    def drop(self, rid: str) -> ReplicaRecord: ...


class Leaving:
    """The retiring and the dozing replicas of a `Table`."""

    def __init__(self, table: Table) -> None:
        self._table = table
        self.retiring: set[str] = set()
        self.dozing: set[str] = set()  # put to sleep, their agents not yet told

    def retire(self, record: ReplicaRecord, why: str, by: float) -> None:
        """Take `record` out of the routing table now, to be let go at `by` at the latest."""
        record.retiring = why
        record.retire_by = by
        self.retiring.add(record.replica.id)
        self._table.changes.reroute((record.replica.model,))
        self._table.changes.version += 1

    def doze(self, record: ReplicaRecord, why: str, by: float) -> None:
        """Put `record` to sleep: out of the routing table now, its agent told at `by` at the
        latest."""
        record.sleep, record.unrouted_in = why, None
        record.retire_by = by
        self.dozing.add(record.replica.id)
        self._table.changes.reroute((record.replica.model,))
        self._table.changes.version += 1

    def wake(self, record: ReplicaRecord) -> None:
        """Wake `record`: its agent is told now, and routers get it back once it serves."""
        record.sleep, record.told_to_sleep, record.unrouted_in = "", False, None
        self.dozing.discard(record.replica.id)
        self._table.changes.reassign(p.node for p in record.replica.shards)
        self._table.changes.reroute((record.replica.model,))
        self._table.changes.version += 1

    def discard(self, rid: str) -> None:
        """`rid` left the table."""
        self.retiring.discard(rid)
        self.dozing.discard(rid)

    def unrouted(self, version: int) -> None:
        """Note that routing `version` is the first without each leaving replica not yet
        noted."""
        for rid in (*self.retiring, *self.dozing):
            record = self._table.replicas[rid]
            if record.unrouted_in is None:
                record.unrouted_in = version

    @staticmethod
    def _confirmed(record: ReplicaRecord, routed_version: int) -> bool:
        """Whether every router holds a table without `record` (`routed_version` or later)."""
        return record.unrouted_in is not None and record.unrouted_in <= routed_version

    def release(self, routed_version: int, now: float) -> list[tuple[str, str]]:
        """Drop from the table the retiring replicas every router has stopped routing to, or
        whose time to retire is up. Returns (replica id, why) for each one released."""
        released = []
        for rid in sorted(self.retiring):
            record = self._table.replicas[rid]
            confirmed = self._confirmed(record, routed_version)
            if confirmed or now >= record.retire_by:
                self._table.drop(rid)
                why = record.retiring if confirmed else f"{record.retiring}; routers unconfirmed"
                self._table.retired[rid] = (why, now)
                released.append((rid, why))
        return released

    def tell_sleepers(self, routed_version: int, now: float) -> list[tuple[str, str]]:
        """Tell the agents of the replicas put to sleep that every router has stopped routing
        to (or whose time is up) to put their engines to sleep. Returns (replica id, why)."""
        told = []
        for rid in sorted(self.dozing):
            record = self._table.replicas[rid]
            if self._confirmed(record, routed_version) or now >= record.retire_by:
                record.told_to_sleep = True
                self.dozing.discard(rid)
                self._table.changes.reassign(p.node for p in record.replica.shards)
                told.append((rid, record.sleep))
        return told
