"""The control plane's indexes (replicas by node, reported shards by replica) agree with a
derivation from the whole table after any sequence of reports, heartbeats, silences,
reconcile passes, catalog changes, marks, failures, releases and forgotten nodes; a pass that
does not plan is one whose plan would change nothing; and every node whose assignment changed
is among those whose held heartbeats are answered: speed changes no decision."""

from __future__ import annotations

import asyncio
from collections import Counter

import yaml
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from modelfleet.agent.gpus import SimulatedGpus
from modelfleet.controlplane import nodes
from modelfleet.controlplane.catalogs import CatalogKeeper
from modelfleet.controlplane.config import ControlPlaneConfig
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.controlplane.records import ReplicaRecord, ReportFirst
from modelfleet.controlplane.state import FleetState
from modelfleet.controlplane.views import replica_views
from modelfleet.core.fleet import Mark
from modelfleet.core.reconcile import Plan, plan
from modelfleet.messages.wire import AgentReport, Heartbeat, ShardReport, ShardState
from modelfleet.store.sqlite import SqliteStore

NODES = ("n1", "n2", "n3")
GPUS = SimulatedGpus("4x80GB")
STATES = (ShardState.STARTING, ShardState.READY, ShardState.FAILED, ShardState.STOPPING)


def on_node_from_scratch(state: FleetState) -> dict[str, set[str]]:
    derived: dict[str, set[str]] = {}
    for rid, record in state.replicas.items():
        for placement in record.replica.shards:
            derived.setdefault(placement.node, set()).add(rid)
    return derived


def seen_from_scratch(state: FleetState) -> dict[str, dict[tuple[str, int], ShardReport]]:
    derived: dict[str, dict[tuple[str, int], ShardReport]] = {}
    for name, record in state.nodes.items():
        for s in record.report.shards:
            derived.setdefault(s.replica_id, {})[(name, s.rank)] = s
    return derived


def of_generation(state: FleetState, record: ReplicaRecord, rank: int) -> ShardReport | None:
    """Shard `rank` as its node reported it, if of the replica's generation."""
    node = state.nodes.get(record.replica.shards[rank].node)
    seen = node.shard(record.replica.id, rank) if node else None
    return seen if seen is not None and seen.generation == record.generation else None


def serving_from_scratch(state: FleetState) -> set[str]:
    return {
        rid
        for rid, record in state.replicas.items()
        if not record.retiring
        and all(
            p.node in state.nodes
            and (rid, rank) in state.nodes[p.node].ready
            and of_generation(state, record, rank) is not None
            for rank, p in enumerate(record.replica.shards)
        )
    }


def busy_from_scratch(state: FleetState) -> set[tuple[str, int]]:
    busy = {
        (name, g)
        for name, record in state.nodes.items()
        for s in record.report.shards
        if s.replica_id not in state.replicas
        for g in s.gpus
    }
    for record in state.replicas.values():
        if record.retiring:
            busy |= record.replica.gpu_slots()
    return busy


def failing_from_scratch(state: FleetState, max_failures: int) -> dict[str, tuple[str, str]]:
    failing = {}
    for rid, record in state.replicas.items():
        if record.retiring:
            continue
        for rank, placement in enumerate(record.replica.shards):
            if len(record.replica.shards) > 1:  # restarted together: by restarts in a row
                seen = of_generation(state, record, rank)
                if seen is not None and seen.state is ShardState.FAILED:
                    if record.group_restarts >= max_failures:
                        why = (
                            f"shard {rank} failed on {placement.node} after "
                            f"{record.group_restarts} restarts of all its shards together"
                        )
                        failing[rid] = (placement.node, f"{why}: {seen.error}")
                    break
                continue
            node = state.nodes.get(placement.node)
            seen = node.shard(rid, rank) if node else None
            if seen is not None and seen.failures >= max_failures:
                why = f"failed {seen.failures} times in a row on {placement.node}"
                failing[rid] = (placement.node, f"{why}: {seen.error}" if seen.error else why)
                break
    return failing


class Fleet(RuleBasedStateMachine):
    timing: dict[str, float] = {}  # the control plane's defaults: nodes go stale, lost

    def __init__(self) -> None:
        super().__init__()
        self.keeper = CatalogKeeper(SqliteStore(":memory:"))
        self.keeper.lead(0.0)
        self.set_catalog(2, 1)
        config = ControlPlaneConfig(admin_token="admin-token-123", settle_for=-1, **self.timing)
        self.cp = ControlPlane(config, self.keeper)
        self.now = 1000.0
        self.seq = dict.fromkeys(NODES, 0)
        self.boot = dict.fromkeys(NODES, "b0")
        # each node's assignment when last checked
        self.versions = {n: self.cp.assignments.of(n, self.keeper.current).version for n in NODES}

    def set_catalog(self, small: int, wide: int, other: int = 1) -> None:
        models = [  # a count of 0 removes the model
            {"name": "small", "engine": "sim", "replicas": small},
            {"name": "wide", "engine": "sim", "replicas": wide, "shards": 2},
            {"name": "other", "engine": "sim", "replicas": other, "node_labels": {"zone": "b"}},
        ]
        models = [m for m in models if m["replicas"]]
        self.keeper.apply(yaml.safe_dump({"models": models}), "api", 0.0)

    @rule(
        node=st.sampled_from(NODES),
        # mostly ready: the routing table only holds replicas every shard of which is
        states=st.lists(
            st.one_of(st.just(ShardState.READY), st.sampled_from(STATES)), min_size=8, max_size=8
        ),
        stranger=st.booleans(),
        restarted=st.booleans(),
    )
    def report(self, node: str, states: list[ShardState], stranger: bool, restarted: bool) -> None:
        """The node reports what it was assigned, in some states, perhaps a shard the table
        does not know (to be adopted), perhaps as a new run of its agent."""
        self.now += 1
        if restarted:
            self.boot[node] = f"b{self.seq[node]}"
        self.seq[node] += 1
        assigned = self.cp.assignments.of(node, self.keeper.current).shards
        shards = [
            ShardReport.of(
                a, st, port=9000 + i, pid=100 + i, failures=3 if st is ShardState.FAILED else 0
            )
            for i, (a, st) in enumerate(zip(assigned, states * 4, strict=False))
        ]
        if stranger:
            stray = self.seq[node] % 3
            shards.append(ShardReport(replica_id=f"stray-{stray}", model="small",
                                      engine_digest="d", rank=0, num_shards=1, gpus=[3],
                                      state=ShardState.READY, port=9990 + stray))  # fmt: skip
        zone = "b" if node == "n3" else "a"  # "other" goes on n3 only
        report = AgentReport(node=node, boot_id=self.boot[node], seq=self.seq[node],
                             address=f"10.0.0.{NODES.index(node)}", gpus=GPUS.gpus(),
                             labels={"zone": zone}, shards=shards)  # fmt: skip
        self.cp.state.take_report(report, self.keeper.current, self.now)

    def beat(self, node: str) -> None:
        """The node beats now: taken when its agent run's report is held, refused otherwise."""
        self.seq[node] += 1
        beat = Heartbeat(node=node, boot_id=self.boot[node], seq=self.seq[node], assignment="")
        record = self.cp.state.nodes.get(node)
        try:
            self.cp.state.take_heartbeat(beat, self.now)
        except ReportFirst:
            assert record is None or record.report.boot_id != self.boot[node]
        else:
            assert record is not None and record.received == self.now

    @rule(node=st.sampled_from(NODES))
    def heartbeat(self, node: str) -> None:
        self.now += 1
        self.beat(node)

    @rule(seconds=st.sampled_from([4, 11, 30, 61]), beating=st.sets(st.sampled_from(NODES)))
    def time_passes(self, seconds: int, beating: set[str]) -> None:
        """Time passes; only the `beating` nodes beat (every 2 s) meanwhile, and passes run:
        the others may go stale, or be lost, with nothing else new to plan from."""
        for _ in range(seconds // 2):
            self.now += 2
            for node in sorted(beating):
                self.beat(node)
            self.reconcile_at_now()

    @rule(small_step=st.booleans())
    def reconcile(self, small_step: bool) -> None:
        self.now += 0.25 if small_step else 1
        self.reconcile_at_now()

    def whole_plan(self, at: float | None = None) -> Plan:
        """What a pass planning the whole fleet at `at` (default: now) would decide (the pass's
        own side effects on failing replicas, keeping their model off their node, included)."""
        cp, state = self.cp, self.cp.state
        at = self.now if at is None else at
        avoid = {
            model: {node: why for node, (until, why) in nodes.items() if at < until}
            for model, nodes in state.faults.avoid.items()
        }
        failing = state.faults.failing(cp.config.max_failures)
        for rid, (node, why) in failing.items():
            avoid.setdefault(state.replicas[rid].replica.model, {})[node] = why
        failed = {rid: why for rid, (_, why) in failing.items()}
        timing = cp.config.heartbeats(len(state.nodes))
        return plan(self.keeper.current, state.planned(), state.serving(), state.node_list(),
                    state.busy_slots(), at, timing.stale_after, failed, avoid,
                    timing.lost_after)  # fmt: skip

    def reconcile_at_now(self) -> None:
        cp, state = self.cp, self.cp.state
        plans, before = cp.plans, dict(state.replicas)
        retiring = {rid for rid, r in before.items() if r.retiring}
        if not cp.settling(self.now):
            # The pass's first step, restarting broken groups, changes what it plans from:
            # taken first, so that the whole plan is made from the same (the pass finds
            # nothing more to restart).
            cp.term.restart_groups()
        whole = None if cp.settling(self.now) else self.whole_plan()
        cp.reconcile_once(self.now)
        if whole is None:
            pass
        elif cp.plans == plans:
            # It did not plan: planning would have changed nothing, as of one reconcile interval
            # ago (what a time brings is planned for up to one interval late, so that nodes
            # going silent one by one are planned for together), or of the last plan if later.
            at = max(cp.term.planned_at, self.now - cp.config.reconcile_interval)
            late = self.whole_plan(at)
            assert not late.new and not late.stop, late
            assert [(p.model, p.count) for p in late.pending] == [
                (p.model, p.count) for p in state.pending
            ]
        elif cp.term.planned_models != len(self.keeper.current.models):
            # It planned some models: what it did is what planning them all would have done.
            made = Counter(
                (r.replica.model, r.replica.shards)
                for rid, r in state.replicas.items()
                if rid not in before
            )
            assert made == Counter((n.model, n.shards) for n in whole.new), whole
            stopped = {rid for rid, r in state.replicas.items() if r.retiring} - retiring
            assert stopped == {stop.replica_id for stop in whole.stop}, whole
            assert sorted((p.model, p.count) for p in whole.pending) == sorted(
                (p.model, p.count) for p in state.pending
            )
        cp.publish()

    @rule(small=st.integers(0, 4), wide=st.integers(0, 2), other=st.integers(0, 2))
    def change_catalog(self, small: int, wide: int, other: int) -> None:
        self.set_catalog(small, wide, other)

    @rule(
        node=st.sampled_from(NODES), mark=st.sampled_from(list(Mark)), grace=st.sampled_from([0, 3])
    )
    def mark(self, node: str, mark: Mark, grace: int) -> None:
        if node in self.cp.state.nodes:
            asyncio.run(nodes.set_mark(self.cp, node, mark, grace))

    @rule(routed=st.integers(0, 50))
    def release(self, routed: int) -> None:
        self.now += 5
        self.cp.state.leaving.release(routed, self.now)

    @rule(node=st.sampled_from(NODES))
    def delete_node(self, node: str) -> None:
        if node in self.cp.state.nodes:
            asyncio.run(nodes.delete_node(self.cp, node, force=True))

    @invariant()
    def every_changed_assignment_is_notified(self) -> None:
        changed = self.cp.state.changed_assignments(self.keeper.current)
        for node in NODES:
            version = self.cp.assignments.of(node, self.keeper.current).version
            if version != self.versions[node]:
                assert node in changed, f"{node}'s assignment changed unnoticed"
                self.versions[node] = version

    @invariant()
    def indexes_agree_with_the_whole_table(self) -> None:
        state = self.cp.state
        assert state._on_node == on_node_from_scratch(state)
        assert state._seen == seen_from_scratch(state)
        whole = self.cp.assignments.everyone(self.keeper.current)
        for node in NODES:
            assert self.cp.assignments.of(node, self.keeper.current).shards == whole.get(node, [])
            holding = sorted(
                rid
                for rid, r in state.replicas.items()
                if not r.retiring and any(s.node == node for s in r.replica.shards)
            )
            assert state.holding(node) == holding
        # What every pass asks, kept between changes, is what working it out anew gives.
        assert set(state.serving()) == serving_from_scratch(state)
        assert state.busy_slots() == busy_from_scratch(state)
        assert dict(state.faults.failing(1)) == failing_from_scratch(state, 1)
        # The routing table is what the replicas' views (as `ctl replicas` shows them) say.
        routed = {m.name: (m.endpoints, m.replicas, m.keys)
                  for m in self.cp.routing.models(self.keeper.current)}  # fmt: skip
        from_views: dict[str, tuple[list[str], dict[str, str], dict[str, str]]] = {
            m.name: ([], {}, {}) for m in self.keeper.current.models
        }
        for view in replica_views(state):
            if view.endpoint and view.model in from_views:
                endpoints, ids, _ = from_views[view.model]
                endpoints.append(view.endpoint)
                ids[view.endpoint] = view.id
        for name, (endpoints, ids, _) in from_views.items():
            assert (sorted(endpoints), ids) == routed[name][:2], name


Fleet.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
test_indexes_agree_with_a_derivation_from_the_whole_table = Fleet.TestCase


class SteadyFleet(Fleet):
    """Nodes that stay fresh and no safety net in sight: most passes that plan plan only the
    models something changed for, and each is checked against planning them all."""

    timing = {"node_stale_after": 1e4, "node_lost_after": 1e4, "reconcile_full_interval": 1e5}


SteadyFleet.TestCase.settings = settings(max_examples=300, stateful_step_count=30, deadline=None)
test_planning_the_changed_models_decides_what_planning_all_would = SteadyFleet.TestCase


def test_a_replica_with_a_shard_stopping_is_not_adopted_but_one_all_running_is() -> None:
    """After a restart the table is empty: a replica one of whose engines its agent is
    stopping stays out of it (it is on its way out), one whose shards all run is adopted."""
    keeper = CatalogKeeper(SqliteStore(":memory:"))
    keeper.lead(0.0)
    keeper.apply(yaml.safe_dump({"models": [{"name": "small", "engine": "sim"}]}), "api", 0.0)
    state = FleetState()

    def shard(rid: str, rank: int, state_: ShardState) -> ShardReport:
        return ShardReport(replica_id=rid, model="small", engine_digest="d", rank=rank,
                           num_shards=2, gpus=[rank], state=state_, port=9000)  # fmt: skip

    def report(node: str, shards: list[ShardReport]) -> AgentReport:
        return AgentReport(node=node, boot_id="b", seq=1, address=f"10.0.0.{node[-1]}",
                           gpus=GPUS.gpus(), shards=shards)  # fmt: skip

    ready, stopping = ShardState.READY, ShardState.STOPPING
    state.take_report(report("n2", [shard("leaving", 1, stopping), shard("running", 1, ready)]),
                      keeper.current, 1.0)  # fmt: skip
    state.take_report(report("n1", [shard("leaving", 0, ready), shard("running", 0, ready)]),
                      keeper.current, 1.0)  # fmt: skip
    assert sorted(state.replicas) == ["running"]
    assert state.replicas["running"].adopted
