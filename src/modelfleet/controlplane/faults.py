"""Replicas that keep failing, and what is done about them: a replica of one shard whose
engine failed too often in a row is replaced elsewhere and its model kept off that node for a
while; a replica of several shards one of which failed is restarted whole, all its shards
together. Worked out from the agents' reports, as the control plane's memory holds them."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol

from modelfleet.controlplane.changes import Changes
from modelfleet.controlplane.records import NodeRecord, ReplicaRecord
from modelfleet.messages.wire import ShardReport, ShardState


class Table(Protocol):
    """What faults read of the control plane's memory (`FleetState`)."""

    @property
    def replicas(self) -> dict[str, ReplicaRecord]: ...

    @property
    def nodes(self) -> dict[str, NodeRecord]: ...

    @property
    def changes(self) -> Changes: ...

    def current(self, record: ReplicaRecord, rank: int) -> ShardReport | None: ...


class Faults:
    """The failing replicas of a `Table`, and the nodes models are kept off."""

    def __init__(self, table: Table) -> None:
        self._table = table
        # replicas some shard of which reports failures (kept by `FleetState` with each report)
        self.faulted: set[str] = set()
        # model -> node -> (until when, why): where a replica of the model kept failing
        self.avoid: dict[str, dict[str, tuple[float, str]]] = {}

    def failing(self, max_failures: int) -> Mapping[str, tuple[str, str]]:
        """Replicas (not retiring) with a shard whose engine failed `max_failures` times in a
        row: replica id -> (node, why)."""
        return self._table.changes.once(
            f"failing {max_failures}", lambda: MappingProxyType(self._failing(max_failures))
        )

    def _failing(self, max_failures: int) -> dict[str, tuple[str, str]]:
        failing = {}
        for rid in sorted(self.faulted):
            record = self._table.replicas.get(rid)
            if record is None or record.retiring:
                continue
            if len(record.replica.shards) > 1:
                # Restarted together, never shard by shard: failing once the restarts in a
                # row reach the bound and it failed again.
                failed = self._failed_shard(record)
                if failed is not None and record.group_restarts >= max_failures:
                    shard_rank, where, report = failed
                    why = (
                        f"shard {shard_rank} failed on {where} after "
                        f"{record.group_restarts} restarts of all its shards together"
                    )
                    failing[rid] = (where, f"{why}: {report.error}")
                continue
            for rank, placement in enumerate(record.replica.shards):
                node = self._table.nodes.get(placement.node)
                seen = node.shard(rid, rank) if node else None
                if seen is not None and seen.failures >= max_failures:
                    why = f"failed {seen.failures} times in a row on {placement.node}"
                    failing[rid] = (placement.node, f"{why}: {seen.error}" if seen.error else why)
                    break
        return failing

    def keep_off(self, model: str, node: str, why: str, until: float) -> None:
        """Place no replica of `model` on `node` until `until`."""
        self.avoid.setdefault(model, {})[node] = (until, why)
        self._table.changes.reroute((model,))
        self._table.changes.version += 1

    def avoided_until(self) -> float | None:
        """When the first model kept off a node may go back on it; None when none is kept off."""
        return min((t for nodes in self.avoid.values() for t, _ in nodes.values()), default=None)

    def avoiding(self, now: float) -> dict[str, dict[str, str]]:
        """model -> node -> why, for what is still kept off at `now` (the rest is forgotten)."""
        for model, nodes in list(self.avoid.items()):
            for node, (until, _) in list(nodes.items()):
                if now >= until:
                    del nodes[node]
            if not nodes:
                del self.avoid[model]
        return {m: {n: why for n, (_, why) in nodes.items()} for m, nodes in self.avoid.items()}

    def broken_groups(self) -> dict[str, str]:
        """Replicas of several shards (not retiring) one shard of which, of the current
        generation, has failed: replica id -> which shard, where, and why."""
        broken = {}
        for rid in sorted(self.faulted):
            record = self._table.replicas.get(rid)
            if record is None or record.retiring or len(record.replica.shards) < 2:
                continue
            failed = self._failed_shard(record)
            if failed is not None:
                rank, node, seen = failed
                broken[rid] = f"shard {rank} on {node} failed: {seen.error}"
        return broken

    def _failed_shard(self, record: ReplicaRecord) -> tuple[int, str, ShardReport] | None:
        """The first shard of `record`'s current generation that reports failed: its rank,
        its node, its report."""
        for rank, placement in enumerate(record.replica.shards):
            seen = self._table.current(record, rank)
            if seen is not None and seen.state is ShardState.FAILED:
                return rank, placement.node, seen
        return None

    def restart_group(self, rid: str, why: str) -> int:
        """Restart every shard of a replica together, with one more generation: each agent
        stops its shard and starts it again, rank 0 first (the others wait for where it
        meets them). Returns the restarts made in a row since the replica last served."""
        record = self._table.replicas[rid]
        record.generation += 1
        record.group_restarts += 1
        record.last_failure = why
        self._table.changes.reassign(p.node for p in record.replica.shards)
        self._table.changes.reroute((record.replica.model,))
        self._table.changes.version += 1
        return record.group_restarts
