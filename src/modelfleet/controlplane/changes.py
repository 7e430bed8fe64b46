"""What changed in the control plane's memory of the fleet (`FleetState`), counted, so that
what is built from it (a pass's plan, each node's assignment, each model's routing) is built
again only after a change that may alter it, and one agent's report costs what that agent
holds. Pure: no I/O, no clock."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

T = TypeVar("T")


@dataclass
class Changes:
    """The counts a `FleetState` moves on at each change."""

    # One more at every change the routing table or the planner may depend on (a replica
    # added, dropped or retiring, a report that changed, a node forgotten or fresh again, a
    # mark, a model kept off a node): the table is built again, and a pass plans, only then.
    version: int = 0
    # The count of changes that may alter an assignment or a model's routing: a model whose
    # `rerouted_at` is above the stamp a pass planned at changed since.
    stamp: int = 0
    # One more whenever the set of nodes the planner may use changed otherwise than by a
    # report's content (a node new, forgotten, or heard from again after going stale).
    membership: int = 0
    # node -> the stamp when a change last may have altered its assignment (`Assignments`
    # keeps each node's until it moves on), and model -> the same for its routing
    # (`RoutingTable` keeps each model's entry until it moves on).
    _node_stamps: dict[str, int] = field(default_factory=dict)
    _model_stamps: dict[str, int] = field(default_factory=dict)
    # the nodes whose assignment may have changed since `take_reassigned` was last asked
    _reassigned: set[str] = field(default_factory=set)
    # What every pass asks and only those changes alter (serving replicas, busy slots,
    # failing replicas): worked out again only after one. name -> (version then, answer).
    _derived: dict[str, tuple[int, Any]] = field(default_factory=dict)

    def reassign(self, nodes: Iterable[str]) -> None:
        """Note that the assignments of `nodes` may have changed."""
        self.stamp += 1
        for node in nodes:
            self._reassigned.add(node)
            self._node_stamps[node] = self.stamp

    def reroute(self, models: Iterable[str]) -> None:
        """Note that the routing of `models` may have changed."""
        self.stamp += 1
        for model in models:
            self._model_stamps[model] = self.stamp

    def rerouted_at(self, model: str) -> int:
        """A number that moves on whenever the model's routing may have changed."""
        return self._model_stamps.get(model, 0)

    def reassigned_at(self, node: str) -> int:
        """A number that moves on whenever the node's assignment may have changed."""
        return self._node_stamps.get(node, 0)

    def take_reassigned(self) -> set[str]:
        """The nodes whose assignment may have changed since this was last asked."""
        taken, self._reassigned = self._reassigned, set()
        return taken

    def once(self, name: str, work: Callable[[], T]) -> T:
        """`work()`'s answer, worked out again only after a change (`version`)."""
        kept = self._derived.get(name)
        if kept is not None and kept[0] == self.version:
            return cast(T, kept[1])
        answer = work()
        self._derived[name] = (self.version, answer)
        return answer
