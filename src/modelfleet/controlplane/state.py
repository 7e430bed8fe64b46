"""What the control plane knows: desired state (catalog, replicas) and actual (agents' reports).

`FleetState` is the control plane's memory. It takes reports and heartbeats in, keeps the
indexes that make one report cost what its node holds, turns reports into the pure core's
`Node`s, and carries out a reconcile `Plan`. It does no I/O and reads no clock: callers pass
`now`. What is built from it when asked lives beside it: assignments (`assignments.py`), the
routing table (`routing.py`), the admin API's views (`views.py`); its records are in
`records.py`.
"""

from __future__ import annotations

import math
import re
import secrets
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar, cast

from modelfleet.controlplane.records import (
    NO_MARK,
    NodeMark,
    NodeRecord,
    ReplicaRecord,
    ReportFirst,
    StaleReport,
)
from modelfleet.core import residency
from modelfleet.core.catalog import Catalog
from modelfleet.core.fleet import Mark, Node, Replica, ShardPlacement, natural_key
from modelfleet.core.placement import Placed, Unplaceable, place
from modelfleet.core.reconcile import Pending, Plan
from modelfleet.messages.wire import AdapterState, AgentReport, Heartbeat, ShardReport, ShardState

T = TypeVar("T")
MAX_NEWS = 10_000
MAX_DROPPED = 1000


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
    # replica id -> why: replicas an operator asked to move (`ctl rebalance`), replaced
    # make-before-break; forgotten when the replica leaves the table
    moving: dict[str, str] = field(default_factory=dict)
    # Indexes, kept up to date by every change instead of derived from the whole table, so
    # that one agent's report costs what that agent holds, not what the fleet holds:
    # node -> the replicas in the table with a shard there;
    _on_node: dict[str, set[str]] = field(default_factory=dict)
    # model -> the replicas of it in the table;
    _of_model: dict[str, set[str]] = field(default_factory=dict)
    # replica id -> (node, rank) -> that shard as its node last reported it;
    _seen: dict[str, dict[tuple[str, int], ShardReport]] = field(default_factory=dict)
    # the nodes, the one heard from longest ago first (a dict keeps the order keys came in);
    _heard: dict[str, None] = field(default_factory=dict)
    # the replicas that are retiring, and those put to sleep whose agents are not yet told;
    _retiring: set[str] = field(default_factory=set)
    _dozing: set[str] = field(default_factory=set)
    _swapping: set[str] = field(default_factory=set)  # adapter swaps waiting for the routers
    # replicas some node reports that are not in the table (engines outside it hold GPUs),
    # and replicas some shard of which reports failures;
    _strays: set[str] = field(default_factory=set)
    _faulted: set[str] = field(default_factory=set)
    # one more whenever the set of nodes the planner may use changed otherwise than by a
    # report's content (a node new, forgotten, or heard from again after going stale);
    _membership: int = 0
    # the nodes whose assignment may have changed since `changed_assignments` was last asked,
    # and the digest of the catalog it was asked with;
    _reassigned: set[str] = field(default_factory=set)
    _assigned_with: str | None = None
    # node -> the count of changes that may alter assignments when its last did (`Assignments`
    # keeps each node's until it moves on), and model -> the same for its routing
    # (`RoutingTable` keeps each model's entry until it moves on).
    _stamps: dict[str, int] = field(default_factory=dict)
    _model_stamps: dict[str, int] = field(default_factory=dict)
    _stamp: int = 0
    # One more at every change the routing table or the planner may depend on (a replica
    # added, dropped or retiring, a report that changed, a node forgotten or fresh again, a
    # mark, a model kept off a node): the table is built again, and a pass plans, only then.
    _changes: int = 0
    # What every pass asks and only those changes alter (serving replicas, busy slots,
    # failing replicas): worked out again only after one. name -> (_changes then, answer).
    _derived: dict[str, tuple[int, Any]] = field(default_factory=dict)
    # Events noted and not yet recorded: (type, reason, regarding, message). The control
    # plane takes them into its event log after each pass (`ControlPlane.record_news`).
    news: list[tuple[str, str, str, str]] = field(default_factory=list)
    # replica id -> the nodes of its shards, for replicas dropped from the table (the newest
    # MAX_DROPPED): their engines' logs stay on those nodes, for `ctl logs`.
    dropped: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # When a node new to this memory last reported (settling waits while they still come).
    newest_node_at: float = -math.inf

    @property
    def version(self) -> int:
        """One more at every change of what the planner plans from, bar the passing of time."""
        return self._changes

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
        self._strays.discard(rid)
        for placement in record.replica.shards:
            self._on_node.setdefault(placement.node, set()).add(rid)
        self._of_model.setdefault(record.replica.model, set()).add(rid)
        self._reassign(p.node for p in record.replica.shards)
        self._reroute((record.replica.model,))

    def _drop(self, rid: str) -> ReplicaRecord:
        self._changes += 1
        self.moving.pop(rid, None)
        record = self.replicas.pop(rid)
        self.dropped[rid] = tuple(p.node for p in record.replica.shards)
        if len(self.dropped) > MAX_DROPPED:
            del self.dropped[next(iter(self.dropped))]
        self._retiring.discard(rid)
        self._dozing.discard(rid)
        self._swapping.discard(rid)
        if rid in self._seen:
            self._strays.add(rid)
        self._reassign(p.node for p in record.replica.shards)
        self._reroute((record.replica.model,))
        of_model = self._of_model[record.replica.model]
        of_model.discard(rid)
        if not of_model:
            del self._of_model[record.replica.model]
        for placement in record.replica.shards:
            held = self._on_node.get(placement.node)
            if held is not None:
                held.discard(rid)
                if not held:
                    del self._on_node[placement.node]
        return record

    def _start_retiring(self, record: ReplicaRecord, why: str, by: float) -> None:
        record.retiring = why
        record.retire_by = by
        self._retiring.add(record.replica.id)
        self._reroute((record.replica.model,))
        self._changes += 1

    def _reassign(self, nodes: Iterable[str]) -> None:
        """Note that the assignments of `nodes` may have changed."""
        self._stamp += 1
        for node in nodes:
            self._reassigned.add(node)
            self._stamps[node] = self._stamp

    def _reroute(self, models: Iterable[str]) -> None:
        """Note that the routing of `models` may have changed."""
        self._stamp += 1
        for model in models:
            self._model_stamps[model] = self._stamp

    def rerouted_at(self, model: str) -> int:
        """A number that moves on whenever the model's routing may have changed."""
        return self._model_stamps.get(model, 0)

    def of_model(self, model: str) -> Collection[str]:
        """The replicas of `model` in the table (retiring ones too)."""
        return self._of_model.get(model, ())

    def reassigned_at(self, node: str) -> int:
        """A number that moves on whenever the node's assignment may have changed."""
        return self._stamps.get(node, 0)

    def on_node(self, node: str) -> Collection[str]:
        """The replicas in the table (retiring ones too) with a shard on `node`."""
        return self._on_node.get(node, ())

    def _node_changed(self, node: str) -> None:
        """`node`'s report changed (or it went). The routing of the models with a replica on
        it may change with it (a shard's state or port), and so may the assignments of every
        node that shares a replica with it: a replica of several shards is assigned where its
        shard 0 meets its peers, as that shard's node reports."""
        held = [self.replicas[rid].replica for rid in self._on_node.get(node, ())]
        for replica in held:
            self._reassign(p.node for p in replica.shards)
        self._reroute({replica.model for replica in held})

    def _hear(self, node: str) -> None:
        self._heard.pop(node, None)
        self._heard[node] = None

    def _index_report(self, node: str, old: AgentReport | None, new: AgentReport | None) -> None:
        """Move `node`'s shards in `_seen` from its old report to its new one, and keep the
        strays and the faulted replicas with them."""
        touched = set()
        if old is not None:
            for s in old.shards:
                touched.add(s.replica_id)
                shards = self._seen.get(s.replica_id)
                if shards is not None:
                    shards.pop((node, s.rank), None)
                    if not shards:
                        del self._seen[s.replica_id]
        if new is not None:
            for s in new.shards:
                touched.add(s.replica_id)
                self._seen.setdefault(s.replica_id, {})[(node, s.rank)] = s
        for rid in touched:
            seen = self._seen.get(rid)
            if seen is not None and rid not in self.replicas:
                self._strays.add(rid)
            else:
                self._strays.discard(rid)
            if seen is not None and any(s.failures for s in seen.values()):
                self._faulted.add(rid)
            else:
                self._faulted.discard(rid)

    # -- actual state --------------------------------------------------------------------

    def take_report(self, report: AgentReport, catalog: Catalog, now: float) -> bool:
        """Record a node's report. Returns whether anything the planner looks at changed."""
        before = self.nodes.get(report.node)
        if before and before.report.boot_id == report.boot_id and report.seq <= before.seq:
            raise StaleReport(
                f"report {report.seq} from {report.node} is not newer than {before.seq}"
            )
        if before is None:
            self._names = None
            self.newest_node_at = now
        taken = before.reports + 1 if before else 1
        self.nodes[report.node] = NodeRecord(
            report, now, self.marks.get(report.node, NO_MARK), taken, before.beats if before else 0
        )
        self._hear(report.node)
        self._index_report(report.node, before.report if before else None, report)
        self._note(report.node, before.report if before else None, report)
        if before is not None and now - before.received > self.stale_after:
            silent = now - before.received
            self.tell(
                "normal", "NodeBack", f"node/{report.node}", f"reports again after {silent:.0f}s"
            )
        for shard in report.shards:
            record = self.replicas.get(shard.replica_id)
            if record is not None and record.group_restarts and self.is_serving(record.replica.id):
                record.group_restarts = 0  # it serves again: restarts in a row start over
        adopted = self._adopt(report, catalog, now)
        if before is None or adopted:
            self._node_changed(report.node)
            self._membership += before is None
            self._changes += 1
            return True
        old, new = before.report, report
        changed = (old.gpus, old.shards, old.labels, old.address) != (
            new.gpus,
            new.shards,
            new.labels,
            new.address,
        )
        if changed:
            self._node_changed(report.node)
        fresh_again = now - before.received > self.stale_after
        self._membership += fresh_again
        changed = changed or fresh_again
        self._changes += changed
        return changed

    def tell(self, kind: str, reason: str, regarding: str, message: str) -> None:
        """Note an event for the control plane to record (`news`); the oldest go past
        MAX_NEWS not taken."""
        self.news.append((kind, reason, regarding, message))
        if len(self.news) > MAX_NEWS:
            del self.news[: len(self.news) - MAX_NEWS]

    def _note(self, node: str, old: AgentReport | None, new: AgentReport) -> None:
        """The events of a report: a node's first, its shards' changes of state, its GPUs'
        changes of health."""
        if old is None:
            gpus = len(new.gpus)
            self.tell("normal", "NodeReported", f"node/{node}", f"{gpus} GPU(s) at {new.address}")
        elif old.boot_id != new.boot_id:
            held = len(new.shards)
            self.tell(
                "normal", "AgentRestarted", f"node/{node}", f"a new agent run, {held} shard(s) held"
            )
        was = {(s.replica_id, s.rank): s for s in old.shards} if old is not None else {}
        for s in new.shards:
            before = was.get((s.replica_id, s.rank))
            where = f"shard {s.rank} on {node}"
            if before is not None and s.restarts > before.restarts:
                # Said even when the failure came and went between two reports (a kill -9 of
                # a serving engine, restarted at once): no report showed it failed.
                why = f": {s.last_failure}" if s.last_failure else ""
                if ShardState.FAILED not in (before.state, s.state):
                    failed = s.last_failure or "its engine exited"
                    self.tell(
                        "warning", "ShardFailed", f"replica/{s.replica_id}", f"{where}: {failed}"
                    )
                self.tell(
                    "warning",
                    "ShardRestarted",
                    f"replica/{s.replica_id}",
                    f"{where} started again by its agent ({s.restarts} restart(s)){why}",
                )
            if before is not None and (before.state, before.generation) == (s.state, s.generation):
                continue
            if s.state is ShardState.STARTING:
                pid = f" (pid {s.pid})" if s.pid is not None else ""
                self.tell("normal", "ShardStarted", f"replica/{s.replica_id}", f"{where}{pid}")
            elif s.state is ShardState.SLEEPING:
                self.tell("normal", "ShardAsleep", f"replica/{s.replica_id}", f"{where} asleep")
            elif (
                s.state is ShardState.READY
                and before is not None
                and (before.state is ShardState.SLEEPING)
            ):
                self.tell("normal", "ShardAwake", f"replica/{s.replica_id}", f"{where} awake")
            elif s.state is ShardState.READY and old is None:
                # The first this control plane heard of the node (it started, or took over),
                # and the engine already serves: taken over as it runs, not started.
                pid = f" (pid {s.pid})" if s.pid is not None else ""
                self.tell(
                    "normal", "ShardAdopted", f"replica/{s.replica_id}", f"{where} serving{pid}"
                )
            elif s.state is ShardState.READY:
                took = f" in {s.startup_s:.1f}s" if s.startup_s is not None else ""
                self.tell("normal", "ShardReady", f"replica/{s.replica_id}", f"{where} ready{took}")
            elif s.state is ShardState.FAILED:
                self.tell(
                    "warning", "ShardFailed", f"replica/{s.replica_id}", f"{where}: {s.error}"
                )
        health = {g.index: g for g in old.gpus} if old is not None else {}
        for g in new.gpus:
            known = health.get(g.index)
            if known is not None and known.healthy == g.healthy:
                continue
            if not g.healthy:
                self.tell("warning", "GpuUnhealthy", f"node/{node}", f"gpu {g.index}: {g.reason}")
            elif known is not None:
                self.tell("normal", "GpuHealthy", f"node/{node}", f"gpu {g.index} healthy again")

    def take_heartbeat(self, beat: Heartbeat, now: float) -> bool:
        """Note that a node is alive and its report unchanged. Returns whether anything the
        planner looks at changed: the node had been silent long enough to be stale.

        Raises ReportFirst when no report of the node's agent run is held, and StaleReport
        when the beat is not newer than what was last taken from it.
        """
        record = self.nodes.get(beat.node)
        if record is None or record.report.boot_id != beat.boot_id:
            raise ReportFirst(
                f"no report from node {beat.node} (agent run {beat.boot_id}) is held: "
                "send the whole report"
            )
        if beat.seq <= record.seq:
            raise StaleReport(
                f"heartbeat {beat.seq} from {beat.node} is not newer than {record.seq}"
            )
        fresh_again = now - record.received > self.stale_after
        if fresh_again:
            silent = now - record.received
            self.tell("normal", "NodeBack", f"node/{beat.node}", f"beats again after {silent:.0f}s")
        record.beat(beat.seq, now)
        self._hear(beat.node)
        self._changes += fresh_again
        self._membership += fresh_again
        return fresh_again

    def next_silence(self, after: float, spans: Iterable[float]) -> float | None:
        """The first time from `after` on at which a node will have been silent for one of
        `spans` seconds (unless heard from before), or None when there is none. A node is
        silent for longer than a span only after that time: a pass then sees it.

        It walks the nodes from the one heard from longest ago, past those silent that long
        already: what it costs grows with the silent nodes, not with the fleet.
        """
        first = None
        for span in spans:
            for name in self._heard:
                at = self.nodes[name].received + span
                if at >= after:
                    first = at if first is None else min(first, at)
                    break
        return first

    def silent_for(self, span: float, now: float) -> list[str]:
        """The nodes not heard from for more than `span` seconds, longest silent first."""
        silent = []
        for name in self._heard:
            if now - self.nodes[name].received <= span:
                break
            silent.append(name)
        return silent

    def changed_assignments(self, catalog: Catalog) -> set[str]:
        """The nodes whose assignment may have changed since this was last asked (for the
        heartbeats held for them to be answered).

        A replica added or dropped changes its nodes'; a changed report of a node, those of
        the nodes its replicas share (the leader's address); another catalog, those holding an
        adopted replica with no spec of its own. An agent that is sent nothing on a change
        missed here gets its assignment with its next heartbeat's answer anyway.
        """
        if catalog.digest != self._assigned_with:
            self._assigned_with = catalog.digest
            for record in self.replicas.values():
                if record.spec is None:
                    self._reassign(p.node for p in record.replica.shards)
        changed, self._reassigned = self._reassigned, set()
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
            generation = max(s.generation for _, s in found.values())
            self._put(ReplicaRecord(replica, spec, adopted=True, generation=generation))
            adopted = True
        return adopted

    def node_list(self) -> list[Node]:
        """Every node that has reported, by name as people read it (node-2 before node-10)."""
        if self._names is None:
            self._names = sorted(self.nodes, key=lambda n: (natural_key(n), n))
        return [self.nodes[name].node for name in self._names]

    def set_mark(self, node: str, mark: NodeMark) -> None:
        self._changes += 1
        self._reroute({self.replicas[rid].replica.model for rid in self._on_node.get(node, ())})
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
            (node, g)
            for rid in self._strays
            for (node, _), s in self._seen[rid].items()
            for g in s.gpus
        }
        for rid in self._retiring:
            busy |= self.replicas[rid].replica.gpu_slots()
        return frozenset(busy)

    def failing(self, max_failures: int) -> Mapping[str, tuple[str, str]]:
        """Replicas (not retiring) with a shard whose engine failed `max_failures` times in a
        row: replica id -> (node, why)."""
        return self._once_per_change(
            f"failing {max_failures}", lambda: MappingProxyType(self._failing(max_failures))
        )

    def _failing(self, max_failures: int) -> dict[str, tuple[str, str]]:
        failing = {}
        for rid in sorted(self._faulted):
            record = self.replicas.get(rid)
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
        self._reroute((model,))
        self._changes += 1

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

    def planned(self) -> list[Replica]:
        """The replicas the planner counts: every one in the table that is not retiring."""
        return [r.replica for r in self.replicas.values() if not r.retiring]

    def serving(self) -> Serving:
        """The replicas every shard of which reports ready (retiring ones excluded): those
        `replica_view` shows as "ready", without building the views. Worked out per replica as
        asked: a pass asks of the replicas of the models it plans."""
        return Serving(self)

    def is_serving(self, rid: str) -> bool:
        record = self.replicas.get(rid)
        if record is None or record.retiring or record.sleep:
            return False
        grouped = len(record.replica.shards) > 1
        for rank, placement in enumerate(record.replica.shards):
            node = self.nodes.get(placement.node)
            if node is None or (rid, rank) not in node.ready:
                return False
            if grouped and self.current(record, rank) is None:
                return False
        return True

    def current(self, record: ReplicaRecord, rank: int) -> ShardReport | None:
        """Shard `rank` of `record` as its node last reported it, if it runs the replica's
        current generation (a shard of an earlier one is being stopped)."""
        node = self.nodes.get(record.replica.shards[rank].node)
        seen = node.shard(record.replica.id, rank) if node else None
        if seen is None or seen.generation != record.generation:
            return None
        return seen

    # -- replicas of several shards, restarted as one ---------------------------------------

    def broken_groups(self) -> dict[str, str]:
        """Replicas of several shards (not retiring) one shard of which, of the current
        generation, has failed: replica id -> which shard, where, and why."""
        broken = {}
        for rid in sorted(self._faulted):
            record = self.replicas.get(rid)
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
            seen = self.current(record, rank)
            if seen is not None and seen.state is ShardState.FAILED:
                return rank, placement.node, seen
        return None

    def restart_group(self, rid: str, why: str) -> int:
        """Restart every shard of a replica together, with one more generation: each agent
        stops its shard and starts it again, rank 0 first (the others wait for where it
        meets them). Returns the restarts made in a row since the replica last served."""
        record = self.replicas[rid]
        record.generation += 1
        record.group_restarts += 1
        record.last_failure = why
        self._reassign(p.node for p in record.replica.shards)
        self._reroute((record.replica.model,))
        self._changes += 1
        return record.group_restarts

    @property
    def stamp(self) -> int:
        """The count of changes that may alter an assignment or a model's routing: a model
        whose `rerouted_at` is above the stamp a pass planned at changed since."""
        return self._stamp

    @property
    def membership(self) -> int:
        """One more whenever a node came, went, or was heard from again after going stale."""
        return self._membership

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
                self._start_retiring(record, stop.reason, now + retire_within)
        for sleep in plan.sleep:
            record = self.replicas.get(sleep.replica_id)
            if record is not None and not record.retiring and not record.sleep:
                record.sleep, record.unrouted_in = sleep.reason, None
                record.retire_by = now + retire_within
                self._dozing.add(sleep.replica_id)
                self._reroute((record.replica.model,))
                self._changes += 1
        for wake in plan.wake:
            record = self.replicas.get(wake.replica_id)
            if record is not None and record.sleep:
                record.sleep, record.told_to_sleep, record.unrouted_in = "", False, None
                self._dozing.discard(wake.replica_id)
                self._reassign(p.node for p in record.replica.shards)
                self._reroute((record.replica.model,))
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

    def move(self, replica_id: str, why: str) -> None:
        """Have a replica replaced elsewhere, make-before-break (`ctl rebalance`)."""
        record = self.replicas[replica_id]
        self.moving[replica_id] = why
        self._changes += 1
        self._reroute((record.replica.model,))

    def retire(self, replica_ids: Collection[str], why: str, now: float) -> None:
        """Take replicas out of service outside a plan (a deleted node's): released at once."""
        for rid in replica_ids:
            record = self.replicas.get(rid)
            if record is not None and not record.retiring:
                self._start_retiring(record, why, now)

    def holding(self, node: str) -> list[str]:
        """The replicas in service (not retiring) with a shard on `node`."""
        return sorted(rid for rid in self._on_node.get(node, ()) if not self.replicas[rid].retiring)

    def holding_nodes(self) -> frozenset[str]:
        """The nodes with a shard of some replica in the table."""
        return frozenset(self._on_node)

    def forget(self, node: str) -> None:
        """Drop a node: its last report and its mark. An agent that reports again is new."""
        self._node_changed(node)
        gone = self.nodes.pop(node, None)
        self._heard.pop(node, None)
        if gone is not None:
            self._index_report(node, gone.report, None)
            self._changes += 1
            self._membership += 1
        self.marks.pop(node, None)
        self._names = None

    def mark_unrouted(self, version: int) -> None:
        """Note that routing `version` is the first without each retiring (or sleeping)
        replica not yet noted."""
        for rid in (*self._retiring, *self._dozing):
            record = self.replicas[rid]
            if record.unrouted_in is None:
                record.unrouted_in = version
        for rid in self._swapping:
            record = self.replicas[rid]
            if record.adapters_unrouted_in is None:
                record.adapters_unrouted_in = version

    def release(self, routed_version: int, now: float) -> list[tuple[str, str]]:
        """Drop from the table the retiring replicas that every router has stopped routing to
        (it holds `routed_version` or later), or whose time to retire is up.

        Their nodes' next assignments leave them out, so their agents stop the engines.
        Returns (replica id, why) for each one released.
        """
        released = []
        for rid in sorted(self._retiring):
            record = self.replicas[rid]
            confirmed = record.unrouted_in is not None and record.unrouted_in <= routed_version
            if confirmed or now >= record.retire_by:
                self._drop(rid)
                why = record.retiring if confirmed else f"{record.retiring}; routers unconfirmed"
                self.retired[rid] = (why, now)
                released.append((rid, why))
        return released

    def tell_sleepers(self, routed_version: int, now: float) -> list[tuple[str, str]]:
        """Tell the agents of the replicas put to sleep that every router has stopped routing
        to (or whose time is up) to put their engines to sleep. Returns (replica id, why)."""
        told = []
        for rid in sorted(self._dozing):
            record = self.replicas[rid]
            confirmed = record.unrouted_in is not None and record.unrouted_in <= routed_version
            if confirmed or now >= record.retire_by:
                record.told_to_sleep = True
                self._dozing.discard(rid)
                self._reassign(p.node for p in record.replica.shards)
                told.append((rid, record.sleep))
        return told

    def place_adapters(
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
        `grace` seconds (`swap_adapters`). Returns how many replicas got another set."""
        changed = self.adapter_changes(catalog, demand, busy)
        for rid, names in changed.items():
            record = self.replicas[rid]
            record.adapters = names
            self._reroute([record.replica.model])
            if set(record.told_adapters) <= set(names):
                self._tell_adapters(record)
            else:
                record.adapters_unrouted_in = None  # a table without them is yet to go out
                if record.swap_by is None:
                    record.swap_by = now + grace
                self._swapping.add(rid)
        return len(changed)

    def _tell_adapters(self, record: ReplicaRecord) -> None:
        record.told_adapters = record.adapters
        record.swap_by = record.adapters_unrouted_in = None
        self._swapping.discard(record.replica.id)
        self._reassign([record.replica.shards[0].node])

    def swaps_waiting(self) -> bool:
        """Whether an adapter swap waits for the routers."""
        return bool(self._swapping)

    def swap_adapters(self, routed_version: int, now: float) -> int:
        """Tell the agents of the replicas whose adapter swaps every router has taken (it
        holds `routed_version` or later), or whose grace is up. Returns how many."""
        told = 0
        for rid in sorted(self._swapping):
            record = self.replicas.get(rid)
            if record is None:
                self._swapping.discard(rid)
                continue
            unrouted = record.adapters_unrouted_in
            if (unrouted is not None and unrouted <= routed_version) or now >= (
                record.swap_by or 0.0
            ):
                self._tell_adapters(record)
                told += 1
        return told

    def adapter_changes(
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
                for rid in self.of_model(spec.name)
                if not self.replicas[rid].retiring
                and not self.replicas[rid].sleep
                and self.replicas[rid].replica.engine_digest == spec.engine_digest
            ]
            failed = {}
            for rid in rids:
                seen = self.current(self.replicas[rid], 0)
                if seen is not None:
                    failed[rid] = {a.name for a in seen.adapters if a.state is AdapterState.FAILED}
            decided = residency.decide(
                [a.name for a in spec.adapters],
                spec.max_loras,
                rids,
                {rid: self.replicas[rid].adapters for rid in rids},
                demand.get(spec.name, {}),
                failed,
                busy,
            )
            for rid, names in decided.items():
                if self.replicas[rid].adapters != names:
                    changed[rid] = names
        return changed

    def asleep(self) -> set[str]:
        """The replicas put to sleep (told so or not yet), not retiring."""
        return {rid for rid, r in self.replicas.items() if r.sleep and not r.retiring}

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


class Serving(Collection[str]):
    """The serving replicas of a `FleetState`, worked out one at a time as asked."""

    def __init__(self, state: FleetState) -> None:
        self._state = state

    def __contains__(self, rid: object) -> bool:
        return isinstance(rid, str) and self._state.is_serving(rid)

    def __iter__(self) -> Iterator[str]:
        return (rid for rid in self._state.replicas if self._state.is_serving(rid))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _new_id(model: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9.-]+", "-", model).strip("-")[:40] or "replica"
    return f"{stem}-{secrets.token_hex(3)}"
