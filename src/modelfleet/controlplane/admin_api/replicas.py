"""Replicas: what runs and why, where the next one would go, rebalancing, the routing table."""

from __future__ import annotations

from fastapi import APIRouter

from modelfleet.controlplane import views
from modelfleet.controlplane.admin_api.shared import Refused, errors, no_such_model
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.messages import admin


def routes(cp: ControlPlane) -> APIRouter:
    api = APIRouter()

    @api.get("/v1/replicas", responses=errors())
    async def replicas() -> admin.ReplicasAnswer:
        """The replicas, their shards and state, and what is pending and why."""
        ejections = cp.loads.ejections(cp.clock.monotonic())
        return views.replicas(cp.state, cp.catalogs.current, cp.autoscaler, ejections)

    @api.get("/v1/replicas/{replica:path}", responses=errors(404))
    async def replica(replica: str) -> admin.ReplicaInfo:
        """One replica with every shard's state, error, restarts, backoff and log tail."""
        record = cp.state.replicas.get(replica)
        if record is None:
            retired = cp.state.retired.get(replica)
            if retired is not None:
                raise Refused.because(404, f"replica {replica!r} was stopped: {retired[0]}")
            known = ", ".join(sorted(cp.state.replicas)) or "none"
            raise Refused.because(404, f"no replica {replica!r} (replicas: {known})")
        ejected = cp.loads.ejections(cp.clock.monotonic()).get(replica, [])
        return views.replica_view(cp.state, record, ejected)

    @api.get("/v1/explain/{model:path}", responses=errors(404))
    async def explain(model: str) -> admin.Explanation:
        """Where the model's next replica would go, or every node and why not."""
        catalog = cp.catalogs.current
        answer = views.explanation(cp.state, catalog, model, cp.clock.monotonic())
        if answer is None:
            raise no_such_model(catalog, model)
        return answer

    @api.post("/v1/rebalance", responses=errors(404, 503))
    async def rebalance(model: str | None = None, dry_run: bool = False) -> admin.RebalanceAnswer:
        """Even out spread models (one, or all) over the nodes that can host them: while a
        node holds two replicas of a model more than another with room, the newest moves
        there, make-before-break and `max_parallel` at a time. With `dry_run`, only say what
        would move."""
        catalog = cp.catalogs.current
        if model is not None and catalog.get(model) is None:
            raise no_such_model(catalog, model)
        moves = cp.rebalance(model, dry_run)
        return admin.RebalanceAnswer(
            dry_run=dry_run,
            moves=[
                admin.MoveInfo(
                    replica=m.replica_id,
                    model=m.model,
                    from_node=m.from_node,
                    to_node=m.to_node,
                    reason=m.reason,
                )
                for m in moves
            ],
        )

    @api.get("/v1/routing", responses=errors())
    async def routing() -> admin.RoutingAnswer:
        """The routing table last pushed to the routers, and what each confirmed."""
        return cp.publisher.answer()

    return api
