"""The planner under random operations: catalog changes, nodes joining and lost, cordons,
drains, GPU faults, agents restarting. After every step the fleet it plans keeps its
invariants, and with nothing more happening it converges."""

from __future__ import annotations

import dataclasses
import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from modelfleet.core.catalog import Catalog
from modelfleet.core.fleet import Gpu, Mark, Node, Replica
from modelfleet.core.reconcile import plan

NOW = 1000.0
STALE_AFTER = 10.0
LOST_AFTER = 60.0
GIB = 2**30
NAMES = ("a", "b", "c")

# Stops that may take a serving replica away although the model then has fewer serving than
# it wants: those are what was asked for, or have no alternative.
_ASKED = ("scaled down", "model removed", "grace period is over")

models = st.lists(
    st.fixed_dictionaries(
        {
            "name": st.sampled_from(NAMES),
            "replicas": st.integers(1, 3),
            "gpus_per_shard": st.integers(1, 2),
            "args": st.sampled_from([[], ["--v2"]]),
        }
    ),
    max_size=3,
    unique_by=lambda m: m["name"],
)


class Fleet(RuleBasedStateMachine):
    """A simulated fleet: the planner's table, which replicas serve, and the nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.catalog = Catalog.new([])
        self.nodes: dict[str, Node] = {}
        self.table: dict[str, Replica] = {}
        self.serving: set[str] = set()
        self.ids = itertools.count()

    # -- what happens to the fleet ---------------------------------------------------------

    @rule(spec=models)
    def change_catalog(self, spec: list[dict[str, object]]) -> None:
        self.catalog = Catalog.new([{"engine": "sim", **m} for m in spec])

    @rule(gpus=st.integers(1, 4))
    def node_joins(self, gpus: int) -> None:
        name = f"n{len(self.nodes)}"
        self.nodes[name] = Node(
            name, tuple(Gpu(i, "SIM", 80 * GIB) for i in range(gpus)), last_report=NOW
        )

    @precondition(lambda self: self.nodes)
    @rule(data=st.data())
    def node_lost(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.nodes)))
        self.nodes[name] = dataclasses.replace(self.nodes[name], last_report=NOW - 1000)
        # Its engines are out of reach: none of its replicas serves any more.
        self.serving -= {rid for rid, r in self.table.items() if self._on(r, name)}

    @precondition(lambda self: self.nodes)
    @rule(data=st.data(), mark=st.sampled_from([Mark.CORDONED, Mark.DRAINING, Mark.NONE]))
    def mark_node(self, data: st.DataObject, mark: Mark) -> None:
        name = data.draw(st.sampled_from(sorted(self.nodes)))
        self.nodes[name] = dataclasses.replace(self.nodes[name], mark=mark, drain_deadline=None)

    @precondition(lambda self: self.nodes)
    @rule(data=st.data(), healthy=st.booleans())
    def gpu_health(self, data: st.DataObject, healthy: bool) -> None:
        name = data.draw(st.sampled_from(sorted(self.nodes)))
        node = self.nodes[name]
        index = data.draw(st.integers(0, len(node.gpus) - 1))
        gpu = dataclasses.replace(
            node.gpus[index], healthy=healthy, reason="" if healthy else "XID 79"
        )
        gpus = (*node.gpus[:index], gpu, *node.gpus[index + 1 :])
        self.nodes[name] = dataclasses.replace(node, gpus=gpus)

    @precondition(lambda self: self.nodes)
    @rule(data=st.data())
    def agent_restarts(self, data: st.DataObject) -> None:
        """An agent comes back: its node reports again; its engines were adopted, so what
        served still serves."""
        name = data.draw(st.sampled_from(sorted(self.nodes)))
        self.nodes[name] = dataclasses.replace(self.nodes[name], last_report=NOW)

    @rule()
    def engines_get_ready(self) -> None:
        lost = {n for n, node in self.nodes.items() if self._lost(node)}
        self.serving = {
            rid for rid, r in self.table.items() if not any(s.node in lost for s in r.shards)
        }

    @rule()
    def reconcile(self) -> None:
        nodes = list(self.nodes.values())
        decided = plan(
            self.catalog,
            list(self.table.values()),
            self.serving,
            nodes,
            set(),
            NOW,
            STALE_AFTER,
            lost_after=LOST_AFTER,
        )
        stopped = {s.replica_id: s.reason for s in decided.stop}
        for model in {r.model for r in self.table.values()}:
            spec = self.catalog.get(model)
            if spec is None:
                continue
            serving = [rid for rid in self.serving if self.table[rid].model == model]
            taken = [
                rid
                for rid in serving
                if rid in stopped and not any(a in stopped[rid] for a in _ASKED)
            ]
            left = len(serving) - len(taken)
            if taken:
                assert left >= min(spec.replicas, len(serving)), (
                    f"{model}: {len(serving)} serving, {len(taken)} stopped for "
                    f"{[stopped[r] for r in taken]}, {spec.replicas} wanted"
                )
        for new in decided.new:
            for shard in new.shards:
                node = self.nodes[shard.node]
                assert node.mark is Mark.NONE, f"placed on {node.name}, {node.mark.value}"
                assert not self._lost(node) and node.last_report == NOW, "placed on a lost node"
                for g in shard.gpus:
                    assert node.gpus[g].healthy, f"placed on unhealthy gpu {g} of {node.name}"
        for rid in stopped:
            self.table.pop(rid, None)
            self.serving.discard(rid)
        for new in decided.new:
            rid = f"{new.model}-{next(self.ids)}"
            self.table[rid] = Replica(rid, new.model, new.engine_digest, new.shards, NOW)
        gone = {r.model for r in self.table.values()} - {m.name for m in self.catalog.models}
        assert not gone, f"replicas of removed models {gone} outlived a pass"

    # -- what always holds -----------------------------------------------------------------

    @invariant()
    def no_gpu_holds_two_shards(self) -> None:
        slots = [(s.node, g) for r in self.table.values() for s in r.shards for g in s.gpus]
        assert len(slots) == len(set(slots)), "two shards on one GPU"

    @invariant()
    def nothing_more_to_do_once_settled(self) -> None:
        """With nothing more happening, a few passes (engines getting ready between them)
        reach a plan with no change. Checked on a copy, so the run goes on from here."""
        copy = Fleet.__new__(Fleet)
        copy.catalog, copy.nodes = self.catalog, dict(self.nodes)
        copy.table, copy.serving = dict(self.table), set(self.serving)
        copy.ids = itertools.count(10**6)
        for _ in range(12):
            copy.reconcile()
            copy.engines_get_ready()
        final = plan(
            copy.catalog,
            list(copy.table.values()),
            copy.serving,
            list(copy.nodes.values()),
            set(),
            NOW,
            STALE_AFTER,
            lost_after=LOST_AFTER,
        )
        assert not final.changes, f"still changing after 12 passes: {final}"

    @staticmethod
    def _on(replica: Replica, node: str) -> bool:
        return any(s.node == node for s in replica.shards)

    @staticmethod
    def _lost(node: Node) -> bool:
        return node.last_report is not None and NOW - node.last_report > LOST_AFTER


Fleet.TestCase.settings = settings(max_examples=300, stateful_step_count=30, deadline=None)
TestPlannerUnderRandomOperations = Fleet.TestCase
