"""When each node was last heard from, in order: which nodes have gone silent, and when the
next one will, at a cost that grows with the silent nodes, not with the fleet. Pure: the
times are passed in."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from modelfleet.controlplane.records import NodeRecord


class Heard:
    """The nodes of `nodes`, the one heard from longest ago first."""

    def __init__(self, nodes: Mapping[str, NodeRecord]) -> None:
        self._nodes = nodes
        self._order: dict[str, None] = {}  # a dict keeps the order keys came in

    def hear(self, node: str) -> None:
        self._order.pop(node, None)
        self._order[node] = None

    def forget(self, node: str) -> None:
        self._order.pop(node, None)

    def next_silence(self, after: float, spans: Iterable[float]) -> float | None:
        """The first time from `after` on at which a node will have been silent for one of
        `spans` seconds (unless heard from before), or None when there is none. A node is
        silent for longer than a span only after that time: a pass then sees it.

        It walks the nodes from the one heard from longest ago, past those silent that long
        already.
        """
        first = None
        for span in spans:
            for name in self._order:
                at = self._nodes[name].received + span
                if at >= after:
                    first = at if first is None else min(first, at)
                    break
        return first

    def silent_for(self, span: float, now: float) -> list[str]:
        """The nodes not heard from for more than `span` seconds, longest silent first."""
        silent = []
        for name in self._order:
            if now - self._nodes[name].received <= span:
                break
            silent.append(name)
        return silent
