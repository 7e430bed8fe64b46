"""What the control plane knows: desired state (catalog, replicas) and actual (agents' reports).

`FleetState` is the control plane's memory. It takes reports and heartbeats in, keeps the
indexes that make one report cost what its node holds, turns reports into the pure core's
`Node`s, and carries out a reconcile `Plan`. It does no I/O and reads no clock: callers pass
`now`. Its parts live beside it, each a concept of its own: what changed (`changes.py`), when
each node was heard from (`heard.py`), replicas taken over as they run (`adoption.py`), the
news a report makes (`report_news.py`), replicas that keep failing (`faults.py`), and the
adapters each replica holds (`adapter_swaps.py`). What is built from it when asked: the
assignments (`assignments.py`), the routing table (`routing.py`), the admin API's views
(`views.py`); its records are in `records.py`.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

from modelfleet.controlplane.adapter_swaps import AdapterSwaps
from modelfleet.controlplane.adoption import adoptable
from modelfleet.controlplane.changes import Changes
from modelfleet.controlplane.faults import Faults
from modelfleet.controlplane.heard import Heard
from modelfleet.controlplane.leaving import Leaving
from modelfleet.controlplane.records import (
    NO_MARK,
    NodeMark,
    NodeRecord,
    ReplicaRecord,
    ReportFirst,
    StaleReport,
)
from modelfleet.controlplane.report_news import TAKING_OVER, report_news
from modelfleet.core.catalog import Catalog
from modelfleet.core.fleet import (
    REPLICA_ID_DIGITS,
    Mark,
    Node,
    Replica,
    natural_key,
    replica_id_stem,
)
from modelfleet.core.reconcile import Pending, Plan
from modelfleet.messages.wire import AgentReport, Heartbeat, ShardReport, ShardState

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
    # the replicas that are retiring, and those put to sleep whose agents are not yet told;
    # replicas some node reports that are not in the table (engines outside it hold GPUs);
    _strays: set[str] = field(default_factory=set)
    changes: Changes = field(default_factory=Changes)
    _assigned_with: str | None = None  # the digest of the catalog assignments were asked with
    # Events noted and not yet recorded: (type, reason, regarding, message). The control
    # plane takes them into its event log after each pass (`ControlPlane.record_news`).
    news: list[tuple[str, str, str, str]] = field(default_factory=list)
    # While a term that takes a fleet over settles: its nodes' first reports and the shards
    # found serving are not told (the term tells what it took over once, settled).
    taking_over: bool = False
    # replica id -> the nodes of its shards, for replicas dropped from the table (the newest
    # MAX_DROPPED): their engines' logs stay on those nodes, for `ctl logs`.
    dropped: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # model -> the nodes of its replica dropped last: where a model scaled to zero may start
    # again while the store is down (`Term.cold_start`).
    last_placed: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # When a node new to this memory last reported (settling waits while they still come).
    newest_node_at: float = -math.inf
    first_node_at: float = math.inf  # when the first node reported to this memory
    faults: Faults = field(init=False)  # replicas that keep failing, nodes models keep off
    adapters: AdapterSwaps = field(init=False)  # which adapters each replica holds
    heard: Heard = field(init=False)  # the nodes, the one heard from longest ago first
    leaving: Leaving = field(init=False)  # replicas retiring, and those put to sleep

    def __post_init__(self) -> None:
        self.faults = Faults(self)
        self.adapters = AdapterSwaps(self)
        self.heard = Heard(self.nodes)
        self.leaving = Leaving(self)

    def _put(self, record: ReplicaRecord) -> None:
        self.changes.version += 1
        rid = record.replica.id
        self.replicas[rid] = record
        self._strays.discard(rid)
        for placement in record.replica.shards:
            self._on_node.setdefault(placement.node, set()).add(rid)
        self._of_model.setdefault(record.replica.model, set()).add(rid)
        self.changes.reassign(p.node for p in record.replica.shards)
        self.changes.reroute((record.replica.model,))

    def drop(self, rid: str) -> ReplicaRecord:
        """Take `rid` out of the table (its nodes' next assignments leave it out)."""
        self.changes.version += 1
        self.moving.pop(rid, None)
        record = self.replicas.pop(rid)
        self.dropped[rid] = tuple(p.node for p in record.replica.shards)
        self.last_placed[record.replica.model] = self.dropped[rid]
        if len(self.dropped) > MAX_DROPPED:
            del self.dropped[next(iter(self.dropped))]
        self.leaving.discard(rid)
        self.adapters.discard(rid)
        if rid in self._seen:
            self._strays.add(rid)
        self.changes.reassign(p.node for p in record.replica.shards)
        self.changes.reroute((record.replica.model,))
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

    def of_model(self, model: str) -> Collection[str]:
        """The replicas of `model` in the table (retiring ones too)."""
        return self._of_model.get(model, ())

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
            self.changes.reassign(p.node for p in replica.shards)
        self.changes.reroute({replica.model for replica in held})

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
                self.faults.faulted.add(rid)
            else:
                self.faults.faulted.discard(rid)

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
            self.first_node_at = min(self.first_node_at, now)
        taken = before.reports + 1 if before else 1
        self.nodes[report.node] = NodeRecord(
            report, now, self.marks.get(report.node, NO_MARK), taken, before.beats if before else 0
        )
        self.heard.hear(report.node)
        self._index_report(report.node, before.report if before else None, report)
        for news in report_news(report.node, before.report if before else None, report):
            if not (self.taking_over and news[1] in TAKING_OVER):
                self.tell(*news)
        if before is not None and now - before.received > self.stale_after:
            silent = now - before.received
            self.tell(
                "normal", "NodeBack", f"node/{report.node}", f"reports again after {silent:.0f}s"
            )
        for shard in report.shards:
            record = self.replicas.get(shard.replica_id)
            if record is not None and record.group_restarts and self.is_serving(record.replica.id):
                record.group_restarts = 0  # it serves again: restarts in a row start over
        adopted = adoptable(report, self._seen, self.replicas, self.retired, catalog, now)
        for record in adopted:
            self._put(record)
        if before is None or adopted:
            self._node_changed(report.node)
            self.changes.membership += before is None
            self.changes.version += 1
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
        self.changes.membership += fresh_again
        changed = changed or fresh_again
        self.changes.version += changed
        return changed

    def tell(self, kind: str, reason: str, regarding: str, message: str) -> None:
        """Note an event for the control plane to record (`news`); the oldest go past
        MAX_NEWS not taken."""
        self.news.append((kind, reason, regarding, message))
        if len(self.news) > MAX_NEWS:
            del self.news[: len(self.news) - MAX_NEWS]

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
        self.heard.hear(beat.node)
        self.changes.version += fresh_again
        self.changes.membership += fresh_again
        return fresh_again

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
                    self.changes.reassign(p.node for p in record.replica.shards)
        return self.changes.take_reassigned()

    def node_list(self) -> list[Node]:
        """Every node that has reported, by name as people read it (node-2 before node-10)."""
        if self._names is None:
            self._names = sorted(self.nodes, key=lambda n: (natural_key(n), n))
        return [self.nodes[name].node for name in self._names]

    def set_mark(self, node: str, mark: NodeMark) -> None:
        self.changes.version += 1
        self.changes.reroute(
            {self.replicas[rid].replica.model for rid in self._on_node.get(node, ())}
        )
        if mark.mark is Mark.NONE:
            self.marks.pop(node, None)
        else:
            self.marks[node] = mark
        if node in self.nodes:
            self.nodes[node].set_mark(mark)

    def busy_slots(self) -> frozenset[tuple[str, int]]:
        """GPU slots the planner may not use beyond the replicas it plans for: those of retiring
        replicas, and those engines outside the table still hold (e.g. ones finishing a stop)."""
        return self.changes.once("busy", self._busy_slots)

    def _busy_slots(self) -> frozenset[tuple[str, int]]:
        busy = {
            (node, g)
            for rid in self._strays
            for (node, _), s in self._seen[rid].items()
            for g in s.gpus
        }
        for rid in self.leaving.retiring:
            busy |= self.replicas[rid].replica.gpu_slots()
        return frozenset(busy)

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

    def failure(self, record: ReplicaRecord) -> str:
        """Why `record`'s engine is failing, in words, or "" when it is not: a shard (of its
        current generation) failed, or started again after failing and not ready since (a
        crash loop shows "starting" most of the time, its error gone with the restart), or
        all its shards restarted together since it last served."""
        for rank in range(len(record.replica.shards)):
            seen = self.current(record, rank)
            if seen is None or seen.state is ShardState.READY:
                continue
            last = seen.last_failure or seen.error or "its engine failed"
            if seen.state is ShardState.FAILED:
                again = f"; restarted {seen.restarts} time(s) so far" if seen.restarts else ""
                return f"shard {rank}: {seen.error or last}{again}"
            if seen.state is ShardState.STARTING and seen.failures > 0:
                return (
                    f"shard {rank}: started again after {seen.failures} failure(s) in a row; "
                    f"the last: {last}"
                )
        if record.group_restarts and not self.is_serving(record.replica.id):
            return (
                f"all its shards restarted together {record.group_restarts} time(s) since it "
                f"last served; the last because {record.last_failure}"
            )
        return ""

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
                self.leaving.retire(record, stop.reason, now + retire_within)
        for sleep in plan.sleep:
            record = self.replicas.get(sleep.replica_id)
            if record is not None and not record.retiring and not record.sleep:
                self.leaving.doze(record, sleep.reason, now + retire_within)
        for wake in plan.wake:
            record = self.replicas.get(wake.replica_id)
            if record is not None and record.sleep:
                self.leaving.wake(record)
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
        self.changes.version += 1
        self.changes.reroute((record.replica.model,))

    def retire(self, replica_ids: Collection[str], why: str, now: float) -> None:
        """Take replicas out of service outside a plan (a deleted node's): released at once."""
        for rid in replica_ids:
            record = self.replicas.get(rid)
            if record is not None and not record.retiring:
                self.leaving.retire(record, why, now)

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
        self.heard.forget(node)
        if gone is not None:
            self._index_report(node, gone.report, None)
            self.changes.version += 1
            self.changes.membership += 1
        self.marks.pop(node, None)
        self._names = None

    def mark_unrouted(self, version: int) -> None:
        """Note that routing `version` is the first without each retiring (or sleeping)
        replica not yet noted."""
        self.leaving.unrouted(version)
        self.adapters.unrouted(version)

    def asleep(self) -> set[str]:
        """The replicas put to sleep (told so or not yet), not retiring."""
        return {rid for rid, r in self.replicas.items() if r.sleep and not r.retiring}

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
    return f"{replica_id_stem(model)}-{secrets.token_hex(REPLICA_ID_DIGITS // 2)}"
