"""The operator's changes to nodes, and a node joining: a mark (cordon, drain, uncordon) set
and kept in the store, a node forgotten, its credential revoked, a join token exchanged for a
credential. Each is told to the event log and wakes the reconcile loop, which moves what the
change moves."""

from __future__ import annotations

import logging
from collections.abc import Callable
from urllib.parse import urlsplit

from modelfleet.controlplane.membership import MembershipRefused
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.controlplane.records import NodeMark
from modelfleet.core.fleet import Mark
from modelfleet.messages.wire import JoinAnswer, JoinRequest
from modelfleet.store import Once, StoredMark

log = logging.getLogger("modelfleet.controlplane")


class MarkRefused(RuntimeError):
    """An operator's mark that cannot be set: the node is unknown (404) or revoked (409)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class NodeBusy(RuntimeError):
    """A node that still holds replicas cannot be deleted without force."""

    def __init__(self, node: str, replicas: list[str]) -> None:
        super().__init__(
            f"node {node} holds replica(s) {', '.join(replicas)}: drain it first, or delete it "
            "with force to place them anew elsewhere at once"
        )
        self.replicas = replicas


async def mark_node(
    cp: ControlPlane, node: str, mark: Mark, grace: float | None, once: Once | None = None
) -> Mark:
    """An operator's cordon, drain (bounded by `grace` seconds, or the configured
    `drain_grace` when None) or uncordon of `node`; returns the mark it had. Raises
    MarkRefused for a node that never reported or was revoked. `once`: its request id."""
    if node not in cp.state.nodes:
        known = ", ".join(sorted(cp.state.nodes)) or "none has reported yet"
        raise MarkRefused(404, f"no node {node!r} has reported (nodes: {known})")
    if cp.state.nodes[node].mark.mark is Mark.REVOKED:
        raise MarkRefused(409, f"node {node} was revoked: it comes back only by joining anew")
    grace = cp.config.drain_grace if grace is None else grace
    return await set_mark(cp, node, mark, grace, once)


async def set_mark(
    cp: ControlPlane, node: str, mark: Mark, grace: float, once: Once | None = None
) -> Mark:
    """Mark `node` (a drain bounded by `grace` seconds; 0: no bound), persist it, and
    return the mark it had. With `once` (its request id), a write that answers too late is
    taken into memory, told and acted on when it lands."""
    wall, mono = cp.clock.time(), cp.clock.monotonic()
    bounded = mark is Mark.DRAINING and grace > 0

    def marked(_: object = None) -> Mark:
        was = cp.state.marks.get(node)  # as it is now, after the write
        cp.state.set_mark(node, NodeMark(mark, mono + grace if bounded else None))
        cp.wake()
        previous = was.mark if was else Mark.NONE
        log.info("node %s marked %s (was %s)", node, mark.value, previous.value)
        bound = f", {grace:.0f}s of grace" if bounded else ""
        cp.events.normal(
            "NodeMarked", f"node/{node}", f"marked {mark.value}{bound} (was {previous.value})"
        )
        return previous

    if mark is Mark.NONE:
        write: Callable[[], None] = lambda: cp.store.clear_mark(node, once)  # noqa: E731
    else:
        stored = StoredMark(node, mark.value, wall, wall + grace if bounded else None)
        write = lambda: cp.store.set_mark(stored, once)  # noqa: E731
    if once is None:
        await cp.calls(write)
    else:
        await cp.calls.change(write, once.id, marked)
    return marked()


async def delete_node(cp: ControlPlane, node: str, force: bool) -> list[str]:
    """Forget `node`. Refused (NodeBusy) while replicas run on it, unless `force`: then
    they are taken out of service at once and placed anew elsewhere. Returns their ids."""
    held = cp.state.holding(node)
    if held and not force:
        raise NodeBusy(node, held)
    joined = cp.membership.has_joined(node)
    # First: a refused write changes nothing. The name is cut off like a revoked one: no
    # join token made before now brings it back, and a credential it holds is deleted.
    await cp.membership.cut_off(node, cp.store_time())
    await cp.calls(cp.store.clear_mark, node)
    held = cp.state.holding(node)  # as it is now, after the writes
    cp.state.retire(held, f"node {node} deleted by an operator", cp.clock.monotonic())
    cp.state.forget(node)
    cp.wake()
    retired = f"; replicas retired: {', '.join(held)}" if held else ""
    revoked = "; its credential revoked" if joined else ""
    log.info("node %s deleted%s%s", node, revoked, retired)
    cp.events.normal("NodeDeleted", f"node/{node}", f"deleted by an operator{revoked}{retired}")
    return held


async def join(cp: ControlPlane, token: str, request: JoinRequest, source: str) -> JoinAnswer:
    """Give a node its credential for a join token, the join having come from address
    `source` (MembershipRefused if not). A name the fleet knows is never given again: a
    node that reports (with the shared agent token too), or one the term waits for; a node
    revoked (or deleted) before joins again only with a token made after that, and is then
    no longer revoked."""
    cp.membership.usable_token(token, cp.store_time())  # the token first: names after it
    node = request.node
    mark = cp.state.marks.get(node)
    revoked = mark is not None and mark.mark is Mark.REVOKED
    known = node in cp.state.nodes or node in (cp.term.roster or ())
    if known and not revoked and not cp.membership.has_joined(node):
        raise MembershipRefused(
            409,
            f"node {node} is a node of the fleet already (it reports with the shared agent "
            f"token): pick another name, or, once that machine is gone for good, delete it "
            f"(`modelfleet ctl nodes delete {node}`) and join again",
        )
    answer = await cp.membership.join(token, request, cp.store_time(), source, reserved_names(cp))
    if revoked:
        await set_mark(cp, node, Mark.NONE, 0)
    log.info("node %s joined", node)
    cp.events.normal("NodeJoined", f"node/{node}", "joined with a join token")
    return answer


def reserved_names(cp: ControlPlane) -> set[str]:
    """The hosts a control plane or router of this fleet is reached by: a node's
    certificate names none of them."""
    names = set(cp.config.certificate_names())
    urls = [r.url for r in cp.config.routers]
    for plane in cp.leadership.planes:
        urls += [plane.agent_url, plane.admin_url]
    names.update(host for url in urls if (host := urlsplit(url).hostname))
    return names


async def revoke_node(cp: ControlPlane, node: str) -> list[str]:
    """Cut `node` off: delete its credential, so that nothing it sends is taken, and mark
    it revoked, so that its replicas are replaced elsewhere as a lost node's are. Returns
    them. MembershipRefused when the node holds no credential (it reports with the fleet's
    shared agent token, which cannot be taken from one node)."""
    if not cp.membership.has_joined(node):
        if node in cp.state.nodes:
            raise MembershipRefused(
                409,
                f"node {node} reports with the fleet's shared agent token, which cannot be "
                "revoked for one node: change agent_token, or join nodes with join tokens",
            )
        raise MembershipRefused(404, f"no node {node!r} has joined")
    await cp.membership.revoke_node(node, cp.store_time())
    replacing = cp.state.holding(node)
    if node in cp.state.nodes:
        await set_mark(cp, node, Mark.REVOKED, 0)
    moved = f"; its replicas are replaced elsewhere: {', '.join(replacing)}"
    log.warning("node %s revoked: its credential is deleted%s", node, moved if replacing else "")
    cp.events.warning(
        "NodeRevoked", f"node/{node}", f"credential revoked{moved if replacing else ''}"
    )
    return replacing
