"""Nodes and their marks: list, cordon/drain/uncordon, forget, cut off."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from modelfleet.controlplane import nodes as node_changes
from modelfleet.controlplane import views
from modelfleet.controlplane.admin_api import once
from modelfleet.controlplane.admin_api.shared import Refused, body_of, errors, read_body
from modelfleet.controlplane.membership import MembershipRefused
from modelfleet.controlplane.nodes import MarkRefused, NodeBusy
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.core.fleet import Mark
from modelfleet.messages import admin
from modelfleet.store import AlreadyMade

MAX_MARK_BYTES = 4096


def routes(cp: ControlPlane) -> APIRouter:
    api = APIRouter()

    @api.get("/v1/nodes", responses=errors())
    async def nodes() -> admin.NodesAnswer:
        """The nodes, their GPUs and health, marks and what runs on them."""
        return views.nodes(cp.state, cp.clock.monotonic(), cp.frozen)

    @api.post(
        "/v1/nodes/{node}/mark",
        responses=errors(400, 404, 413, 503),
        openapi_extra=body_of(admin.MarkRequest),
        response_model=admin.MarkAnswer,
    )
    async def mark_node(node: str, request: Request) -> admin.MarkAnswer | Response:
        """Cordon, drain or uncordon a node, and say what moves because of it. Made at most
        once per `Idempotency-Key`."""
        body = await read_body(request, admin.MarkRequest, MAX_MARK_BYTES)
        grace = cp.config.drain_grace if body.grace_s is None else body.grace_s
        if body.dry_run:
            if node not in cp.state.nodes:
                raise Refused.because(404, f"no node {node!r}")
            mark = cp.state.marks.get(node)
            was = mark.mark if mark is not None else Mark.NONE
            preview = await cp.preview(cp.catalogs.current, {node: Mark(body.mark)})
        else:
            route = f"POST /v1/nodes/{node}/mark"
            try:
                was_before = cp.state.marks.get(node)
                note = once.begin(
                    cp, request, route, was=(was_before.mark if was_before else Mark.NONE).value
                )
                was = await node_changes.mark_node(cp, node, Mark(body.mark), body.grace_s, note)
            except AlreadyMade as exc:
                made = exc.request
                answer = admin.MarkAnswer(
                    node=node,
                    mark=body.mark,
                    was=made.outcome.get("was", Mark.NONE.value),
                    drain_grace_s=None,
                    steps=[],
                    pending=[],
                )
                return once.replayed(route, made, answer)
            except MarkRefused as exc:
                raise Refused.because(exc.status, str(exc)) from None
            preview = await cp.preview(cp.catalogs.current)
        moves, pending = views.steps(preview)
        draining = body.mark == Mark.DRAINING.value and grace > 0
        cannot_move = []
        if body.mark == Mark.DRAINING.value:
            stuck = {p.model for p in pending}
            for rid in cp.state.holding(node):
                model = cp.state.replicas[rid].replica.model
                if model in stuck:
                    cannot_move.append(f"{rid} ({model})")
        return admin.MarkAnswer(
            node=node,
            mark=body.mark,
            was=was.value,
            drain_grace_s=grace if draining else None,
            steps=moves,
            pending=pending,
            dry_run=body.dry_run,
            cannot_move=cannot_move,
        )

    @api.delete("/v1/nodes/{node}", responses=errors(404, 409, 503))
    async def delete_node(node: str, force: bool = False) -> admin.NodeDeleted:
        """Forget a node. Refused while replicas run on it, unless `force`: then they are
        placed anew elsewhere at once. An agent that reports again comes back as a new node."""
        if node not in cp.state.nodes:
            known = ", ".join(sorted(cp.state.nodes)) or "none has reported yet"
            raise Refused.because(404, f"no node {node!r} has reported (nodes: {known})")
        try:
            retired = await node_changes.delete_node(cp, node, force)
        except NodeBusy as exc:
            raise Refused.because(409, str(exc)) from None
        return admin.NodeDeleted(node=node, retired=retired)

    @api.post("/v1/nodes/{node}/revoke", responses=errors(404, 409, 503))
    async def revoke_node(node: str) -> admin.NodeRevoked:
        """Cut a node off at once: its credential is deleted (nothing it sends is taken), and
        its replicas are replaced elsewhere as a lost node's are. It comes back only by
        joining anew with a join token."""
        try:
            replacing = await node_changes.revoke_node(cp, node)
        except MembershipRefused as exc:
            raise Refused.because(exc.status, str(exc)) from None
        return admin.NodeRevoked(node=node, replacing=replacing)

    return api
