"""The control plane's own status: leading or following, settling, passes, the store."""

from __future__ import annotations

from fastapi import APIRouter

from modelfleet.controlplane import views
from modelfleet.controlplane.admin_api.shared import errors
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.messages import admin


def routes(cp: ControlPlane) -> APIRouter:
    api = APIRouter()

    @api.get("/v1/status", responses=errors())
    async def status() -> admin.StatusAnswer:
        """Whether the control plane is settling, how many passes it made, what is current."""
        state = cp.state
        return admin.StatusAnswer(
            settling=cp.settling(cp.clock.monotonic()),
            reconcile_passes=cp.passes,
            reconcile_plans=cp.plans,
            last_plan_ms=_ms(cp.last_plan_s),
            last_idle_pass_ms=_ms(cp.last_idle_pass_s),
            heartbeat_interval=cp.config.heartbeats(len(state.nodes)).interval,
            catalog_version=cp.catalogs.current.version,
            routing_epoch=cp.publisher.epoch,
            routing_version=cp.publisher.version,
            nodes=len(state.nodes),
            replicas=len(state.replicas),
            pending=sum(p.count for p in state.pending),
            failed=sum(views.replica_state(state, r) == "failed" for r in state.replicas.values()),
            frozen=cp.frozen,
            store_problem=cp.calls.problem() or cp.leadership.problem,
            store=cp.store.where,
            leading=cp.acting(),
            leader=cp.leadership.leader,
            lease_epoch=cp.leadership.epoch,
            lease_refused=cp.leadership.refused,
            control_planes=_control_planes(cp),
            scaling=views.scaling(cp.autoscaler, cp.catalogs.current),
        )

    return api


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def _control_planes(cp: ControlPlane) -> list[admin.ControlPlaneInfo]:
    """Every control plane on the store, as the last lease renewal read them (no store call:
    status answers at once whatever the store does), seen that much longer ago since."""
    leadership = cp.leadership
    since = max(0.0, cp.clock.monotonic() - leadership.planes_read_at)
    return [
        admin.ControlPlaneInfo(
            name=p.name,
            agent_url=p.agent_url,
            admin_url=p.admin_url,
            seen_ago_s=round(max(0.0, p.seen_ago_s + since), 3),
            leads=p.name == leadership.leader,
            answering=p.name == leadership.holder,
        )
        for p in leadership.planes
    ]
