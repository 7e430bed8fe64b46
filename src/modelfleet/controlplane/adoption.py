"""Running replicas a control plane does not know of, taken into its table as they run.

After a restart (or a failover) the table is empty while engines still run: adopting them,
instead of placing anew, is what keeps a restart from churning the fleet. A replica is
adopted once every one of its shards has been reported; surplus ones are then scaled away by
the planner like any other. Pure."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from modelfleet.controlplane.records import ReplicaRecord
from modelfleet.core.catalog import Catalog
from modelfleet.core.fleet import Replica, ShardPlacement
from modelfleet.messages.wire import AgentReport, ShardReport, ShardState


def adoptable(
    report: AgentReport,
    seen: Mapping[str, Mapping[tuple[str, int], ShardReport]],
    table: Collection[str],
    retired: Collection[str],
    catalog: Catalog,
    now: float,
) -> list[ReplicaRecord]:
    """The replicas `report` completes that are neither in the `table` nor `retired`: each
    shard of them reported (`seen`: replica id -> (node, rank) -> its shard's last report)
    and none stopping. Each keeps its spec if the catalog's engine is still the one it runs."""
    adopted: dict[str, ReplicaRecord] = {}
    for shard in report.shards:
        rid = shard.replica_id
        if rid in table or rid in retired or rid in adopted or shard.state is ShardState.STOPPING:
            continue
        found: dict[int, tuple[str, ShardReport]] = {
            rank: (name, s)
            for (name, rank), s in seen.get(rid, {}).items()
            if s.state is not ShardState.STOPPING
        }
        if len(found) < shard.num_shards:
            continue
        placements = tuple(
            ShardPlacement(found[rank][0], tuple(found[rank][1].gpus))
            for rank in range(shard.num_shards)
        )
        spec = catalog.get(shard.model)
        if spec is not None and spec.engine_digest != shard.engine_digest:
            spec = None
        replica = Replica(rid, shard.model, shard.engine_digest, placements, now)
        generation = max(s.generation for _, s in found.values())
        adopted[rid] = ReplicaRecord(replica, spec, adopted=True, generation=generation)
    return list(adopted.values())
