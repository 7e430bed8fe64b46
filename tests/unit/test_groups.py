"""A replica of several shards is one unit: when one shard fails, it leaves the routing table
with that report, and every shard is restarted together, rank 0 first (a new generation).
Reports in, assignments and routing out, on the control plane in-process."""

from __future__ import annotations

import io

import yaml
from rich.console import Console

from modelfleet.agent.gpus import SimulatedGpus
from modelfleet.controlplane.catalogs import CatalogKeeper
from modelfleet.controlplane.config import ControlPlaneConfig
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.controlplane.views import replica_views
from modelfleet.ctl.render import print_replica
from modelfleet.messages.wire import AgentReport, ShardAssignment, ShardReport, ShardState
from modelfleet.store.sqlite import SqliteStore

NODES = {"n1": "10.0.0.1", "n2": "10.0.0.2", "n3": "10.0.0.3", "n4": "10.0.0.4"}


class Fleet:
    """A control plane, one 2-shard model, nodes of one GPU each that report what they are
    told in the states the test gives."""

    def __init__(self, nodes: int = 2) -> None:
        keeper = CatalogKeeper(SqliteStore(":memory:"))
        keeper.lead(0.0)
        models = [{"name": "wide", "engine": "sim", "shards": 2}]
        keeper.apply(yaml.safe_dump({"models": models}), "api", 0.0)
        self.cp = ControlPlane(ControlPlaneConfig(admin_token="t" * 8, settle_for=-1), keeper)
        self.nodes = list(NODES)[:nodes]
        self.seq = 0
        self.now = 100.0
        self.port = 9000
        for node in self.nodes:
            self.report(node, {})
        self.cp.reconcile_once(self.now)

    def assigned(self, node: str) -> list[ShardAssignment]:
        return self.cp.assignments.of(node, self.cp.catalogs.current).shards

    def report(
        self, node: str, states: dict[int, tuple[ShardState, str]], generation: int | None = None
    ) -> None:
        """`node` reports its assigned shards of the ranks in `states` (state, error), as of
        the generation it is assigned now (or `generation`); then a pass runs."""
        self.seq += 1
        self.now += 1
        shards = []
        for a in self.assigned(node):
            if a.rank not in states:
                continue
            state, error = states[a.rank]
            self.port += 1
            seen = {"port": self.port, "error": error}
            if a.rank == 0:
                seen["dist_port"] = self.port + 1000
            if state is ShardState.FAILED:
                seen["failures"] = 1
            if generation is not None:
                a = a.model_copy(update={"generation": generation})
            shards.append(ShardReport.of(a, state, **seen))
        report = AgentReport(node=node, boot_id="b", seq=self.seq, address=NODES[node],
                             gpus=SimulatedGpus("1x80GB").gpus(), shards=shards)  # fmt: skip
        self.cp.state.take_report(report, self.cp.catalogs.current, self.now)
        self.cp.reconcile_once(self.now)

    def rank_node(self, rank: int) -> str:
        [record] = [r for r in self.cp.state.replicas.values() if not r.retiring]
        return record.replica.shards[rank].node

    def routed(self) -> list[str]:
        [model] = self.cp.routing.models(self.cp.catalogs.current)
        return model.endpoints

    def serve(self) -> None:
        """Rank 0 then rank 1 start and report ready."""
        first, second = self.rank_node(0), self.rank_node(1)
        self.report(first, {0: (ShardState.READY, "")})
        [rank1] = self.assigned(second)
        assert rank1.leader is not None and rank1.leader.startswith(NODES[first])
        self.report(second, {1: (ShardState.READY, "")})


READY = (ShardState.READY, "")


def test_a_failed_shard_takes_its_replica_out_and_restarts_every_shard_rank_0_first() -> None:
    fleet = Fleet()
    first, second = fleet.rank_node(0), fleet.rank_node(1)
    assert {first, second} == {"n1", "n2"}
    [rank1] = fleet.assigned(second)
    assert rank1.leader is None  # waits for rank 0 to say where it meets its peers
    fleet.serve()
    assert len(fleet.routed()) == 1

    fleet.report(second, {1: (ShardState.FAILED, "engine exited (1)")})
    assert fleet.routed() == []  # out of the routing table with the report that said so
    [rank0], [rank1] = fleet.assigned(first), fleet.assigned(second)
    assert (rank0.generation, rank1.generation) == (1, 1)  # both restart, not rank 1 alone
    # Rank 0 of generation 0 still reports ready: rank 1 must not meet it, nor route to it.
    assert rank1.leader is None
    fleet.report(first, {0: READY}, generation=0)  # before its agent got the news
    assert fleet.routed() == [] and fleet.assigned(second)[0].leader is None
    [view] = replica_views(fleet.cp.state)
    assert view.group_restarts == 1 and view.generation == 1
    assert view.last_failure == f"shard 1 on {second} failed: engine exited (1)"
    shown = io.StringIO()
    print_replica(view, Console(file=shown, width=200))
    said = "restarted together 1 time(s) (1 since it last served); the last because shard 1"
    assert f"{said} on {second} failed: engine exited (1)" in shown.getvalue()

    fleet.serve()  # generation 1: rank 0 first, then rank 1 once it knows where rank 0 is
    assert len(fleet.routed()) == 1
    [view] = replica_views(fleet.cp.state)
    assert view.state == "ready" and view.group_restarts == 0  # it served: the count is over


def test_a_shard_that_cannot_start_fails_the_whole_replica_with_its_error() -> None:
    fleet = Fleet(nodes=4)
    first, second = fleet.rank_node(0), fleet.rank_node(1)
    error = "cannot start vllm: /models/missing: No such file or directory"
    max_failures = fleet.cp.config.max_failures
    for restart in range(1, max_failures + 1):
        fleet.report(first, {0: READY})
        fleet.report(second, {1: (ShardState.FAILED, error)})
        [view] = [v for v in replica_views(fleet.cp.state) if v.state != "retiring"]
        assert view.group_restarts == restart and error in view.last_failure
    # Failed again after max_failures restarts together: stopped and placed anew, off the
    # node whose shard could not start, with that shard's error.
    fleet.report(first, {0: READY})
    fleet.report(second, {1: (ShardState.FAILED, error)})
    retiring = [v for v in replica_views(fleet.cp.state) if v.state == "retiring"]
    assert len(retiring) == 1 and error in retiring[0].reason, retiring
    assert second in fleet.cp.state.faults.avoid["wide"]
    [placed] = [r for r in fleet.cp.state.replicas.values() if not r.retiring]
    assert second not in {s.node for s in placed.replica.shards}
