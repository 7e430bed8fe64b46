"""What the control plane knows: desired state (catalog, replicas) and actual (agents' reports).

`FleetState` is the control plane's memory. It takes reports in, turns them into the pure
core's `Node`s, carries out a reconcile `Plan`, and answers the questions the agent API, the
admin API and the publisher ask. It does no I/O and reads no clock: callers pass `now`.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar, cast

from modelfleet.admin import ReplicaInfo, ReplicaState, ShardInfo
from modelfleet.catalog import Catalog, ModelSpec
from modelfleet.fleet import Gpu, Mark, Node, Replica, ShardPlacement
from modelfleet.placement import Placed, Unplaceable, place
from modelfleet.reconcile import Pending, Plan
from modelfleet.wire import (
    AgentReport,
    NodeAssignment,
    RoutedModel,
    ShardAssignment,
    ShardReport,
    ShardState,
)

T = TypeVar("T")


class StaleReport(ValueError):
    """A report older than one already taken from the same agent run."""


@dataclass(frozen=True)
class NodeMark:
    """An operator's mark on a node; `drain_deadline` is on the control plane's clock."""

    mark: Mark
    drain_deadline: float | None = None


NO_MARK = NodeMark(Mark.NONE)


@dataclass
class NodeRecord:
    """One node: its latest report, when it arrived, and what is derived from it once per
    report (not once per pass): the core's `Node`, and its shards by (replica id, rank)."""

    report: AgentReport
    received: float
    mark: NodeMark = NO_MARK
    reports: int = 1  # taken from this node since the control plane started
    node: Node = field(init=False)
    shards: dict[tuple[str, int], ShardReport] = field(init=False)
    ready: frozenset[tuple[str, int]] = field(init=False)  # the shards that report ready

    def __post_init__(self) -> None:
        r = self.report
        self.shards = {(s.replica_id, s.rank): s for s in r.shards}
        self.ready = frozenset(k for k, s in self.shards.items() if s.state is ShardState.READY)
        gpus = tuple(
            Gpu(g.index, g.model, g.memory_total, g.memory_used, g.healthy, g.reason)
            for g in r.gpus
        )
        labels = MappingProxyType(dict(r.labels))
        self.node = Node(r.node, gpus, r.address, labels, self.received)
        self.set_mark(self.mark)

    def set_mark(self, mark: NodeMark) -> None:
        self.mark = mark
        self.node = dataclasses.replace(
            self.node, mark=mark.mark, drain_deadline=mark.drain_deadline
        )

    def shard(self, replica_id: str, rank: int) -> ShardReport | None:
        return self.shards.get((replica_id, rank))


@dataclass
class ReplicaRecord:
    """A replica in the table, with the model spec it was started from.

    A replica being taken out of service is `retiring` (why) until the routers have confirmed a
    routing table without it (`unrouted_in` is the first routing version that left it out), or
    `retire_by` has passed; only then is it dropped from its nodes' assignments, so its agent
    stops the engine, which finishes the requests already in flight.
    """

    replica: Replica
    spec: ModelSpec | None  # None for an adopted replica whose spec is no longer current
    adopted: bool = False
    retiring: str = ""
    unrouted_in: int | None = None
    retire_by: float = 0.0


@dataclass
class FleetState:
    """The control plane's memory of the fleet."""

    stale_after: float = 10.0
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    replicas: dict[str, ReplicaRecord] = field(default_factory=dict)
    pending: tuple[Pending, ...] = ()
    marks: dict[str, NodeMark] = field(default_factory=dict)  # only marked nodes
    # replica id -> (why it was stopped, when it was released): an agent that still reports one
    # is stopping it, and it must not be adopted back
    retired: dict[str, tuple[str, float]] = field(default_factory=dict)
    _names: list[str] | None = None  # the nodes' names, sorted; None when a node was added
    # model -> node -> (until when, why): where a replica of the model kept failing
    avoid: dict[str, dict[str, tuple[float, str]]] = field(default_factory=dict)
    # Indexes, kept up to date by every change instead of derived from the whole table, so
    # that one agent's report costs what that agent holds, not what the fleet holds:
    # node -> the replicas in the table with a shard there;
    _on_node: dict[str, set[str]] = field(default_factory=dict)
    # replica id -> (node, rank) -> that shard as its node last reported it.
    _seen: dict[str, dict[tuple[str, int], ShardReport]] = field(default_factory=dict)
    # One more at every change the routing table may depend on (a replica added, dropped or
    # retiring, a report that changed, a node forgotten): the table is built again only then.
    _changes: int = 0
    _routed: tuple[tuple[int, str], list[RoutedModel]] | None = None
    # What every pass asks and only those changes alter (serving replicas, busy slots,
    # failing replicas): worked out again only after one. name -> (_changes then, answer).
    _derived: dict[str, tuple[int, Any]] = field(default_factory=dict)

    def _once_per_change(self, name: str, work: Callable[[], T]) -> T:
        kept = self._derived.get(name)
        if kept is not None and kept[0] == self._changes:
            return cast(T, kept[1])
        answer = work()
        self._derived[name] = (self._changes, answer)
        return answer

    def _put(self, record: ReplicaRecord) -> None:
        self._changes += 1
        rid = record.replica.id
        self.replicas[rid] = record
        for placement in record.replica.shards:
            self._on_node.setdefault(placement.node, set()).add(rid)

    def _drop(self, rid: str) -> ReplicaRecord:
        self._changes += 1
        record = self.replicas.pop(rid)
        for placement in record.replica.shards:
            held = self._on_node.get(placement.node)
            if held is not None:
                held.discard(rid)
                if not held:
                    del self._on_node[placement.node]
        return record

    def _index_report(self, node: str, old: AgentReport | None, new: AgentReport | None) -> None:
        """Move `node`'s shards in `_seen` from its old report to its new one."""
        if old is not None:
            for s in old.shards:
                shards = self._seen.get(s.replica_id)
                if shards is not None:
                    shards.pop((node, s.rank), None)
                    if not shards:
                        del self._seen[s.replica_id]
        if new is not None:
            for s in new.shards:
                self._seen.setdefault(s.replica_id, {})[(node, s.rank)] = s

    # -- actual state --------------------------------------------------------------------

    def take_report(self, report: AgentReport, catalog: Catalog, now: float) -> bool:
        """Record a node's report. Returns whether anything the planner looks at changed."""
        before = self.nodes.get(report.node)
        if before and before.report.boot_id == report.boot_id and report.seq <= before.report.seq:
            raise StaleReport(
                f"report {report.seq} from {report.node} is not newer than {before.report.seq}"
            )
        if before is None:
            self._names = None
        taken = before.reports + 1 if before else 1
        self.nodes[report.node] = NodeRecord(
            report, now, self.marks.get(report.node, NO_MARK), taken
        )
        self._index_report(report.node, before.report if before else None, report)
        adopted = self._adopt(report, catalog, now)
        if before is None or adopted:
            self._changes += 1
            return True
        old, new = before.report, report
        changed = (old.gpus, old.shards, old.labels, old.address) != (
            new.gpus,
            new.shards,
            new.labels,
            new.address,
        )
        self._changes += changed
        return changed

    def _adopt(self, report: AgentReport, catalog: Catalog, now: float) -> bool:
        """Take into the table running replicas this control plane does not know of.

        After a restart the table is empty while engines still run: adopting them, instead of
        placing anew, is what keeps a restart from churning the fleet. A replica is adopted once
        every one of its shards has been reported; surplus ones are then scaled away by the
        planner like any other.
        """
        adopted = False
        for shard in report.shards:
            rid = shard.replica_id
            if rid in self.replicas or rid in self.retired or shard.state is ShardState.STOPPING:
                continue
            found: dict[int, tuple[str, ShardReport]] = {
                rank: (name, s)
                for (name, rank), s in self._seen.get(rid, {}).items()
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
            self._put(ReplicaRecord(replica, spec, adopted=True))
            adopted = True
        return adopted

    def node_list(self) -> list[Node]:
        """Every node that has reported, by name."""
        if self._names is None:
            self._names = sorted(self.nodes)
        return [self.nodes[name].node for name in self._names]

    def set_mark(self, node: str, mark: NodeMark) -> None:
        if mark.mark is Mark.NONE:
            self.marks.pop(node, None)
        else:
            self.marks[node] = mark
        if node in self.nodes:
            self.nodes[node].set_mark(mark)

    def busy_slots(self) -> frozenset[tuple[str, int]]:
        """GPU slots the planner may not use beyond the replicas it plans for: those of retiring
        replicas, and those engines outside the table still hold (e.g. ones finishing a stop)."""
        return self._once_per_change("busy", self._busy_slots)

    def _busy_slots(self) -> frozenset[tuple[str, int]]:
        busy = {
            (name, g)
            for name, record in self.nodes.items()
            for s in record.report.shards
            if s.replica_id not in self.replicas
            for g in s.gpus
        }
        for record in self.replicas.values():
            if record.retiring:
                busy |= record.replica.gpu_slots()
        return frozenset(busy)

    def failing(self, max_failures: int) -> Mapping[str, tuple[str, str]]:
        """Replicas (not retiring) with a shard whose engine failed `max_failures` times in a
        row: replica id -> (node, why)."""
        return self._once_per_change(
            f"failing {max_failures}", lambda: MappingProxyType(self._failing(max_failures))
        )

    def _failing(self, max_failures: int) -> dict[str, tuple[str, str]]:
        failing = {}
        for rid, record in self.replicas.items():
            if record.retiring:
                continue
            for rank, placement in enumerate(record.replica.shards):
                node = self.nodes.get(placement.node)
                seen = node.shard(rid, rank) if node else None
                if seen is not None and seen.failures >= max_failures:
                    why = f"failed {seen.failures} times in a row on {placement.node}"
                    failing[rid] = (placement.node, f"{why}: {seen.error}" if seen.error else why)
                    break
        return failing

    def keep_off(self, model: str, node: str, why: str, until: float) -> None:
        """Place no replica of `model` on `node` until `until`."""
        self.avoid.setdefault(model, {})[node] = (until, why)

    def avoiding(self, now: float) -> dict[str, dict[str, str]]:
        """model -> node -> why, for what is still kept off at `now` (the rest is forgotten)."""
        for model, nodes in list(self.avoid.items()):
            for node, (until, _) in list(nodes.items()):
                if now >= until:
                    del nodes[node]
            if not nodes:
                del self.avoid[model]
        return {m: {n: why for n, (_, why) in nodes.items()} for m, nodes in self.avoid.items()}

    def planned(self) -> list[Replica]:
        """The replicas the planner counts: every one in the table that is not retiring."""
        return [r.replica for r in self.replicas.values() if not r.retiring]

    def shard_views(self, record: ReplicaRecord) -> list[ShardInfo]:
        views = []
        for rank, placement in enumerate(record.replica.shards):
            node = self.nodes.get(placement.node)
            seen = node.shard(record.replica.id, rank) if node else None
            views.append(
                ShardInfo(
                    rank=rank,
                    node=placement.node,
                    gpus=list(placement.gpus),
                    state=seen.state.value if seen else "assigned",
                    port=seen.port if seen else None,
                    pid=seen.pid if seen else None,
                    restarts=seen.restarts if seen else 0,
                    failures=seen.failures if seen else 0,
                    backoff_s=seen.backoff_s if seen else None,
                    startup_s=seen.startup_s if seen else None,
                    error=seen.error if seen else "",
                    log_tail=list(seen.log_tail) if seen else [],
                    engine_key_set=bool(seen and seen.engine_key),
                )
            )
        return views

    def replica_view(self, record: ReplicaRecord) -> ReplicaInfo:
        shards = self.shard_views(record)
        states = {s.state for s in shards}
        state: ReplicaState
        if record.retiring:
            state = "retiring"
        elif states == {ShardState.READY.value}:
            state = "ready"
        elif ShardState.FAILED.value in states:
            state = "failed"
        elif ShardState.STARTING.value in states:
            state = "starting"
        else:
            state = "assigned"
        endpoint = None
        if state == "ready":
            leader = self.nodes[shards[0].node].report.address
            endpoint = f"http://{leader}:{shards[0].port}"
        r = record.replica
        return ReplicaInfo(
            id=r.id,
            model=r.model,
            state=state,
            endpoint=endpoint,
            shards=shards,
            reason=record.retiring,
        )

    def replica_views(self) -> list[ReplicaInfo]:
        records = sorted(self.replicas.values(), key=lambda r: (r.replica.model, r.replica.id))
        return [self.replica_view(r) for r in records]

    def serving(self) -> frozenset[str]:
        """Ids of the replicas every shard of which reports ready (retiring ones excluded):
        those `replica_view` shows as "ready", without building the views."""
        return self._once_per_change("serving", self._serving)

    def _serving(self) -> frozenset[str]:
        serving = set()
        nodes = self.nodes
        for rid, record in self.replicas.items():
            if record.retiring:
                continue
            for rank, placement in enumerate(record.replica.shards):
                node = nodes.get(placement.node)
                if node is None or (rid, rank) not in node.ready:
                    break
            else:
                serving.add(rid)
        return frozenset(serving)

    # -- desired state -------------------------------------------------------------------

    def apply(
        self, plan: Plan, catalog: Catalog, now: float, retire_within: float
    ) -> list[Replica]:
        """Carry out a reconcile plan on the table; return the replicas it created.

        A stopped replica starts retiring: it leaves the routing table at once but stays
        assigned (its engine keeps serving what is in flight) until `release` lets it go,
        at the latest `retire_within` seconds from now.
        """
        for stop in plan.stop:
            record = self.replicas.get(stop.replica_id)
            if record is not None and not record.retiring:
                record.retiring = stop.reason
                record.retire_by = now + retire_within
                self._changes += 1
        created = []
        for new in plan.new:
            spec = catalog.get(new.model)
            replica = Replica(_new_id(new.model), new.model, new.engine_digest, new.shards, now)
            self._put(ReplicaRecord(replica, spec))
            created.append(replica)
        self.pending = plan.pending
        # Forget a released replica once no agent reports it, and its last assignment is older
        # than a report could be (an agent may have started it and not yet said so).
        for rid, (_, released_at) in list(self.retired.items()):
            if rid not in self._seen and now - released_at > self.stale_after:
                del self.retired[rid]
        return created

    def retire(self, replica_ids: Collection[str], why: str, now: float) -> None:
        """Take replicas out of service outside a plan (a deleted node's): released at once."""
        for rid in replica_ids:
            record = self.replicas.get(rid)
            if record is not None and not record.retiring:
                record.retiring = why
                record.retire_by = now
                self._changes += 1

    def holding(self, node: str) -> list[str]:
        """The replicas in service (not retiring) with a shard on `node`."""
        return sorted(rid for rid in self._on_node.get(node, ()) if not self.replicas[rid].retiring)

    def forget(self, node: str) -> None:
        """Drop a node: its last report and its mark. An agent that reports again is new."""
        gone = self.nodes.pop(node, None)
        if gone is not None:
            self._index_report(node, gone.report, None)
            self._changes += 1
        self.marks.pop(node, None)
        self._names = None

    def mark_unrouted(self, version: int) -> None:
        """Note that routing `version` is the first without each retiring replica not yet noted."""
        for record in self.replicas.values():
            if record.retiring and record.unrouted_in is None:
                record.unrouted_in = version

    def release(self, routed_version: int, now: float) -> list[tuple[str, str]]:
        """Drop from the table the retiring replicas that every router has stopped routing to
        (it holds `routed_version` or later), or whose time to retire is up.

        Their nodes' next assignments leave them out, so their agents stop the engines.
        Returns (replica id, why) for each one released.
        """
        released = []
        for rid, record in list(self.replicas.items()):
            if not record.retiring:
                continue
            confirmed = record.unrouted_in is not None and record.unrouted_in <= routed_version
            if confirmed or now >= record.retire_by:
                self._drop(rid)
                why = record.retiring if confirmed else f"{record.retiring}; routers unconfirmed"
                self.retired[rid] = (why, now)
                released.append((rid, why))
        return released

    def assignment(self, node: str, catalog: Catalog) -> NodeAssignment:
        """The node's whole desired shard set."""
        return NodeAssignment(node=node, shards=self._assignments(catalog, node).get(node, []))

    def assignments(self, catalog: Catalog) -> dict[str, list[ShardAssignment]]:
        """Every node's desired shards, in one walk of the table (for a whole-fleet view)."""
        return self._assignments(catalog, None)

    def _assignments(self, catalog: Catalog, only: str | None) -> dict[str, list[ShardAssignment]]:
        by_node: dict[str, list[ShardAssignment]] = {}
        if only is None:
            records: Iterable[ReplicaRecord] = self.replicas.values()
        else:
            records = [self.replicas[rid] for rid in self._on_node.get(only, ())]
        for record in records:
            r = record.replica
            spec = record.spec or catalog.get(r.model)
            if spec is None:
                continue  # adopted, and its model is gone: nothing to start it from
            if only is not None and all(p.node != only for p in r.shards):
                continue
            leader = self._leader(r) if len(r.shards) > 1 else None
            for rank, placement in enumerate(r.shards):
                if only is not None and placement.node != only:
                    continue
                by_node.setdefault(placement.node, []).append(
                    ShardAssignment(
                        replica_id=r.id,
                        model=r.model,
                        engine=spec.engine,
                        source=spec.source,
                        args=list(spec.args),
                        env=dict(spec.env),
                        command=spec.command,
                        rank=rank,
                        num_shards=len(r.shards),
                        gpus=list(placement.gpus),
                        engine_digest=r.engine_digest,
                        startup_timeout=spec.startup_timeout,
                        leader=leader,
                    )
                )
        for shards in by_node.values():
            shards.sort(key=lambda a: (a.replica_id, a.rank))  # the same whichever way built
        return by_node

    def _leader(self, replica: Replica) -> str | None:
        """Where shard 0 of `replica` meets its peers, as its agent reported; None until then."""
        first = self.nodes.get(replica.shards[0].node)
        seen = first.shard(replica.id, 0) if first else None
        if first is None or seen is None or seen.dist_port is None:
            return None
        return f"{first.report.address}:{seen.dist_port}"

    def routing_models(self, catalog: Catalog) -> list[RoutedModel]:
        """Every model of `catalog` with the endpoints of its serving replicas, and the
        catalog's routing fields.

        Only models of that catalog are published, and never a retiring replica: a replica of a
        removed model is not routed to, whatever state it is in. Built again only when the
        table or the catalog changed since it was last built: a pass with nothing new costs
        nothing here.
        """
        made_from = (self._changes, catalog.digest)
        if self._routed is not None and self._routed[0] == made_from:
            return self._routed[1]
        routed = self._routing_models(catalog)
        self._routed = (made_from, routed)
        return routed

    def _routing_models(self, catalog: Catalog) -> list[RoutedModel]:
        endpoints: dict[str, list[str]] = {m.name: [] for m in catalog.models}
        keys: dict[str, dict[str, str]] = {m.name: {} for m in catalog.models}
        ids: dict[str, dict[str, str]] = {m.name: {} for m in catalog.models}
        # The serving replicas, read straight from their shard 0's report: building each
        # replica's whole view (every shard's log tail) cost most of a publish at scale.
        for rid in self.serving():
            record = self.replicas[rid]
            model = record.replica.model
            node = self.nodes[record.replica.shards[0].node]
            seen = node.shard(rid, 0)
            if model not in endpoints or seen is None or seen.port is None:
                continue
            endpoint = f"http://{node.report.address}:{seen.port}"
            endpoints[model].append(endpoint)
            ids[model][endpoint] = rid
            if seen.engine_key is not None:
                keys[model][endpoint] = seen.engine_key
        return [
            RoutedModel(
                name=m.name,
                endpoints=sorted(endpoints[m.name]),
                keys=keys[m.name],
                replicas=ids[m.name],
                routing=m.routing,
                first_byte_timeout=m.first_byte_timeout,
                max_tokens_cap=m.max_tokens_cap,
                max_tokens_over_cap=m.max_tokens_over_cap,
            )
            for m in catalog.models
        ]

    def explain(self, catalog: Catalog, model: str, now: float) -> Placed | Unplaceable | None:
        """Where the next replica of `model` would go, or why it could go nowhere.

        None when `catalog` has no such model.
        """
        spec = catalog.get(model)
        if spec is None:
            return None
        on_node: Counter[str] = Counter()
        for replica in self.planned():
            if replica.model == model:
                on_node.update(s.node for s in replica.shards)
        avoid = self.avoiding(now).get(model, {})
        nodes, used = self.node_list(), self.used_slots()
        return place(spec, nodes, used, on_node, now, self.stale_after, avoid)

    def used_slots(self) -> set[tuple[str, int]]:
        """Every GPU slot taken: by replicas in the table, or by engines still holding one."""
        used = set(self.busy_slots())
        for record in self.replicas.values():
            used |= record.replica.gpu_slots()
        return used

    def pending_for(self, model: str) -> Pending | None:
        """The last pass's pending replicas of `model`, if any."""
        return next((p for p in self.pending if p.model == model), None)


def _new_id(model: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9.-]+", "-", model).strip("-")[:40] or "replica"
    return f"{stem}-{secrets.token_hex(3)}"
