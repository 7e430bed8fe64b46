"""Which LoRA adapters each replica holds, and swaps of them made make-before-break: a replica
that only gains adapters is told at once; one that lets some go stops being routed to for
them first, and its agent is told (unload, then load) once every router holds a table
without them, or after a grace. The decision itself is the pure core's (`residency.py`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import Protocol

from modelfleet.controlplane.changes import Changes
from modelfleet.controlplane.records import ReplicaRecord
from modelfleet.core import residency
from modelfleet.core.catalog import Catalog
from modelfleet.messages.wire import AdapterState, ShardReport


class Table(Protocol):
    """What adapter swaps read of the control plane's memory (`FleetState`)."""

    @property
    def replicas(self) -> dict[str, ReplicaRecord]: ...

    @property
    def changes(self) -> Changes: ...

    def of_model(self, model: str) -> Collection[str]: ...

    def current(self, record: ReplicaRecord, rank: int) -> ShardReport | None: ...


class AdapterSwaps:
    """The adapters of the replicas of a `Table`, and the swaps waiting for the routers."""

    def __init__(self, table: Table) -> None:
        self._table = table
        self._swapping: set[str] = set()  # replicas whose swaps wait for the routers

    def discard(self, rid: str) -> None:
        """`rid` left the table."""
        self._swapping.discard(rid)

    def unrouted(self, version: int) -> None:
        """Note that routing `version` is the first without each swap's adapters not yet
        noted."""
        for rid in self._swapping:
            record = self._table.replicas[rid]
            if record.adapters_unrouted_in is None:
                record.adapters_unrouted_in = version

    def place(
        self,
        catalog: Catalog,
        demand: Mapping[str, Mapping[str, residency.Want]],
        now: float,
        grace: float,
        busy: Mapping[str, float] = MappingProxyType({}),
    ) -> int:
        """Decide which adapters each replica of each model with adapters holds (`residency`),
        from what it holds and `demand` (model -> adapter -> how much it is wanted). A replica
        that only gains adapters is told at once; one that lets some go stops being routed to
        for them now, and is told (to unload, then load) once the routers confirm, or after
        `grace` seconds (`swap`). Returns how many replicas got another set."""
        changed = self.changes_for(catalog, demand, busy)
        for rid, names in changed.items():
            record = self._table.replicas[rid]
            record.adapters = names
            self._table.changes.reroute([record.replica.model])
            if set(record.told_adapters) <= set(names):
                self._tell(record)
            else:
                record.adapters_unrouted_in = None  # a table without them is yet to go out
                if record.swap_by is None:
                    record.swap_by = now + grace
                self._swapping.add(rid)
        return len(changed)

    def _tell(self, record: ReplicaRecord) -> None:
        record.told_adapters = record.adapters
        record.swap_by = record.adapters_unrouted_in = None
        self._swapping.discard(record.replica.id)
        self._table.changes.reassign([record.replica.shards[0].node])

    def waiting(self) -> bool:
        """Whether an adapter swap waits for the routers."""
        return bool(self._swapping)

    def swap(self, routed_version: int, now: float) -> int:
        """Tell the agents of the replicas whose adapter swaps every router has taken (it
        holds `routed_version` or later), or whose grace is up. Returns how many."""
        told = 0
        for rid in sorted(self._swapping):
            record = self._table.replicas.get(rid)
            if record is None:
                self._swapping.discard(rid)
                continue
            unrouted = record.adapters_unrouted_in
            if (unrouted is not None and unrouted <= routed_version) or now >= (
                record.swap_by or 0.0
            ):
                self._tell(record)
                told += 1
        return told

    def changes_for(
        self,
        catalog: Catalog,
        demand: Mapping[str, Mapping[str, residency.Want]],
        busy: Mapping[str, float] = MappingProxyType({}),
    ) -> dict[str, tuple[str, ...]]:
        """The replicas whose adapters `catalog` and `demand` change: replica id -> the
        adapters it would hold. Only replicas that keep their engine under `catalog` (same
        engine digest) count: the others are replaced, and their successors load afresh."""
        changed = {}
        for spec in catalog.models:
            if spec.max_loras is None:
                continue
            rids = [
                rid
                for rid in self._table.of_model(spec.name)
                if not self._table.replicas[rid].retiring
                and not self._table.replicas[rid].sleep
                and self._table.replicas[rid].replica.engine_digest == spec.engine_digest
            ]
            failed = {}
            for rid in rids:
                seen = self._table.current(self._table.replicas[rid], 0)
                if seen is not None:
                    failed[rid] = {a.name for a in seen.adapters if a.state is AdapterState.FAILED}
            decided = residency.decide(
                [a.name for a in spec.adapters],
                spec.max_loras,
                rids,
                {rid: self._table.replicas[rid].adapters for rid in rids},
                demand.get(spec.name, {}),
                failed,
                busy,
            )
            for rid, names in decided.items():
                if self._table.replicas[rid].adapters != names:
                    changed[rid] = names
        return changed
