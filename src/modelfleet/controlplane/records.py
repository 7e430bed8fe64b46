"""What the control plane keeps of each node and each replica, and the refusals of a report.

`FleetState` (`state.py`) holds these records; a `NodeRecord` is made once per report taken,
so that what is derived from a report (the core's `Node`, shards by id) is derived once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType

from modelfleet.core.catalog import ModelSpec
from modelfleet.core.fleet import Gpu, Mark, Node, Replica
from modelfleet.messages.wire import AgentReport, ShardReport, ShardState


class StaleReport(ValueError):
    """A report or heartbeat older than one already taken from the same agent run."""


class ReportFirst(LookupError):
    """A heartbeat from a node this control plane holds no report of, or none of that agent run
    (it restarted, or the node was forgotten): the agent must send its whole report."""


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
    received: float  # when it was last heard from: its report, or a heartbeat since
    mark: NodeMark = NO_MARK
    reports: int = 1  # taken from this node since the control plane started
    beats: int = 0  # heartbeats taken from it since the control plane started
    seq: int = field(init=False)  # of the last report or heartbeat taken
    node: Node = field(init=False)
    shards: dict[tuple[str, int], ShardReport] = field(init=False)
    ready: frozenset[tuple[str, int]] = field(init=False)  # the shards that report ready

    def __post_init__(self) -> None:
        r = self.report
        self.seq = r.seq
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

    def beat(self, seq: int, now: float) -> None:
        """The node was heard from at `now`, its report unchanged."""
        self.seq = seq
        self.received = now
        self.beats += 1
        self.node = dataclasses.replace(self.node, last_report=now)

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
    # A replica of several shards: the generation its shards run (one more at each restart of
    # them all together), the restarts since it last served, and why the last one was made.
    generation: int = 0
    group_restarts: int = 0
    last_failure: str = ""
    # A replica of a model whose idle replicas sleep, put to sleep (why): it leaves the routing
    # table at once, and its agent is told to sleep once every router has confirmed a table
    # without it (`unrouted_in`, as for retiring), or at `retire_by`.
    sleep: str = ""
    told_to_sleep: bool = False
    # A replica of a model with LoRA adapters: those it should hold, as last decided
    # (`residency.py`), which routers may send their requests to once it has them loaded; and
    # those its agent is told to hold. A swap is make-before-break: adapters it is to let go
    # leave the routing table first, and its agent is told the new set (unload, then load)
    # once every router holds a table without them (`unrouted_in`, as for retiring), or at
    # `swap_by`.
    adapters: tuple[str, ...] = ()
    told_adapters: tuple[str, ...] = ()
    adapters_unrouted_in: int | None = None
    swap_by: float | None = None  # set while a swap waits for the routers
