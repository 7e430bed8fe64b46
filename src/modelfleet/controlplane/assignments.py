"""Each node's assignment: its desired shard set, worked out from the table when an agent asks.

An assignment is kept once worked out, until a change that may alter it (`FleetState` stamps
the nodes whose assignments may have changed): a heartbeat, every interval of every node, is
checked against the kept version without building anything.
"""

from __future__ import annotations

from collections.abc import Iterable

from modelfleet.controlplane.records import ReplicaRecord
from modelfleet.controlplane.state import FleetState
from modelfleet.core.catalog import Catalog, ModelSpec
from modelfleet.messages.wire import NodeAssignment, ShardAssignment, assignment_version


class Assignments:
    """The assignments of the nodes of one `FleetState`."""

    def __init__(self, state: FleetState) -> None:
        self.state = state
        # node -> (the node's stamp and the catalog's digest then, its shards, their version)
        self._kept: dict[str, tuple[tuple[int, str], list[ShardAssignment], str]] = {}

    def of(self, node: str, catalog: Catalog, heartbeat_interval: float = 2.0) -> NodeAssignment:
        """The node's whole desired shard set, with its version, and the heartbeat interval
        to tell its agent."""
        _, shards, version = self._kept_for(node, catalog)
        return NodeAssignment(
            node=node, shards=shards, version=version, heartbeat_interval=heartbeat_interval
        )

    def version(self, node: str, catalog: Catalog) -> str:
        """The version of the node's assignment (what a heartbeat is checked against)."""
        return self._kept_for(node, catalog)[2]

    def everyone(self, catalog: Catalog) -> dict[str, list[ShardAssignment]]:
        """Every node's desired shards, in one walk of the table (for a whole-fleet view)."""
        return _build(self.state, catalog, self.state.replicas.values(), None)

    def _kept_for(
        self, node: str, catalog: Catalog
    ) -> tuple[tuple[int, str], list[ShardAssignment], str]:
        made_from = (self.state.changes.reassigned_at(node), catalog.digest)
        kept = self._kept.get(node)
        if kept is None or kept[0] != made_from:
            state = self.state
            records = [state.replicas[rid] for rid in state.on_node(node)]
            shards = _build(state, catalog, records, node).get(node, [])
            kept = (made_from, shards, assignment_version(shards))
            self._kept[node] = kept
        return kept

    def forget(self, node: str) -> None:
        self._kept.pop(node, None)


def _build(
    state: FleetState, catalog: Catalog, records: Iterable[ReplicaRecord], only: str | None
) -> dict[str, list[ShardAssignment]]:
    """The shards of `records` by node (those on node `only`, if given)."""
    by_node: dict[str, list[ShardAssignment]] = {}
    for record in records:
        r = record.replica
        spec = record.spec or catalog.get(r.model)
        if spec is None:
            continue  # adopted, and its model is gone: nothing to start it from
        leader = _leader(state, record) if len(r.shards) > 1 else None
        for rank, placement in enumerate(r.shards):
            if only is not None and placement.node != only:
                continue
            by_node.setdefault(placement.node, []).append(
                shard_assignment(
                    spec,
                    replica_id=r.id,
                    rank=rank,
                    num_shards=len(r.shards),
                    gpus=placement.gpus,
                    engine_digest=r.engine_digest,
                    leader=leader,
                    generation=record.generation,
                    asleep=record.told_to_sleep,
                    adapters=_adapters(catalog.get(r.model) or spec, record) if rank == 0 else {},
                )
            )
    for shards in by_node.values():
        shards.sort(key=lambda a: (a.replica_id, a.rank))  # the same whichever way built
    return by_node


def shard_assignment(
    spec: ModelSpec,
    *,
    replica_id: str,
    rank: int,
    num_shards: int,
    gpus: Iterable[int],
    engine_digest: str,
    leader: str | None = None,
    generation: int = 0,
    asleep: bool = False,
    adapters: dict[str, str] | None = None,
) -> ShardAssignment:
    """What an agent is told to run for shard `rank` of a replica of `spec`'s model: the
    catalog's engine settings, and where this shard stands in its replica."""
    return ShardAssignment(
        replica_id=replica_id,
        model=spec.name,
        engine=spec.engine,
        source=spec.source,
        args=list(spec.args),
        env=dict(spec.env),
        command=spec.command,
        program=spec.program,
        rank=rank,
        num_shards=num_shards,
        gpus=list(gpus),
        engine_digest=engine_digest,
        startup_timeout=spec.startup_timeout,
        leader=leader,
        generation=generation,
        sleep_mode=spec.idle_action == "sleep",
        asleep=asleep,
        sleep_level=spec.sleep_level,
        max_loras=spec.max_loras,
        max_lora_rank=spec.max_lora_rank,
        adapters=adapters or {},
    )


def _adapters(spec: ModelSpec, record: ReplicaRecord) -> dict[str, str]:
    """The adapters the replica's engine should hold, each with its source in `spec` (the
    current catalog's: adapters change without the replica being replaced; one gone from it
    since its residency was decided is left out)."""
    sources = {a.name: a.source for a in spec.adapters}
    return {name: sources[name] for name in record.told_adapters if name in sources}


def _leader(state: FleetState, record: ReplicaRecord) -> str | None:
    """Where shard 0 of `record`'s replica meets its peers, as its agent reported for the
    current generation; None until then (its peers wait)."""
    seen = state.current(record, 0)
    if seen is None or seen.dist_port is None:
        return None
    first = state.nodes[record.replica.shards[0].node]
    return f"{first.report.address}:{seen.dist_port}"
