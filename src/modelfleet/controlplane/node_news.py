"""What a term tells of its nodes as passes see them: the nodes that went stale or lost, a
draining node that holds nothing any more (once per drain), and the silent nodes holding
nothing that are forgotten (their marks taken out of the store after the pass)."""

from __future__ import annotations

import logging

from modelfleet.controlplane.config import ControlPlaneConfig, Heartbeats
from modelfleet.controlplane.events import EventLog
from modelfleet.controlplane.state import FleetState
from modelfleet.core.fleet import Mark
from modelfleet.store import StoreError
from modelfleet.store.calls import StoreCalls

log = logging.getLogger("modelfleet.controlplane")


class NodeNews:
    """One term's news of the nodes of its `state`."""

    def __init__(self, state: FleetState, config: ControlPlaneConfig, events: EventLog) -> None:
        self.state = state
        self.config = config
        self.events = events
        self._silent: dict[str, set[str]] = {"stale": set(), "lost": set()}
        self._drained: set[str] = set()  # draining nodes told drained
        self.forgotten: set[str] = set()  # nodes forgotten whose marks the store still holds

    def forget_silent(self, now: float) -> None:
        """Forget nodes silent for `node_forget_after` that hold no replica (their marks
        leave the store after the pass: `forgotten`)."""
        for name in self.state.heard.silent_for(self.config.node_forget_after, now):
            if not self.state.holding(name):
                silent = now - self.state.nodes[name].received
                log.info(
                    "node %s forgotten: no report for %.0fs and no replica on it", name, silent
                )
                self.events.normal(
                    "NodeForgotten", f"node/{name}", f"no report for {silent:.0f}s, no replica"
                )
                self.state.forget(name)
                self.forgotten.add(name)

    def note_silences(self, now: float, timing: Heartbeats) -> None:
        """Event the nodes that went stale or lost since the last look (those heard from
        again are told by the state, `NodeBack`)."""
        for kind, span in (("stale", timing.stale_after), ("lost", timing.lost_after)):
            silent = set(self.state.heard.silent_for(span, now))
            for node in sorted(silent - self._silent[kind]):
                quiet = now - self.state.nodes[node].received
                self.events.warning(
                    f"Node{kind.capitalize()}", f"node/{node}", f"no word for {quiet:.0f}s"
                )
            self._silent[kind] = silent

    def note_drains(self) -> None:
        """Event each draining node that holds nothing any more, once per drain."""
        draining = {n for n, m in self.state.marks.items() if m.mark is Mark.DRAINING}
        self._drained &= draining
        for node in sorted(draining - self._drained):
            if not self.state.on_node(node):
                self._drained.add(node)
                self.events.normal("NodeDrained", f"node/{node}", "drained: nothing runs there")

    async def clear_marks(self, calls: StoreCalls) -> None:
        """Take the marks of the nodes forgotten out of the store (a mark of a node nobody
        knows does no harm meanwhile: tried again after the next pass)."""
        for node in list(self.forgotten):
            try:
                await calls(calls.store.clear_mark, node)
            except StoreError as exc:
                log.debug("cannot clear the mark of forgotten node %s yet: %s", node, exc)
                return
            self.forgotten.discard(node)
