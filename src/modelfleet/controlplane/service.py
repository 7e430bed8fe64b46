"""The control plane: the agent API, the admin API, the reconcile loop and the publisher.

A thin shell around `FleetState` and the pure planner. Two listeners on their own ports: the
agent API (`POST /v1/report`, agent token) and the admin API (nodes, replicas, catalog;
admin token). The reconcile loop runs every `reconcile_interval` seconds and at once after a
report that changed something; each pass that changes the routing table pushes one whole
snapshot to every router, and the current one is re-pushed every `push_interval` seconds so a
router that restarted or missed a push heals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelfleet.catalog import Catalog
from modelfleet.controlplane.config import DEFAULT_SETTLE_FOR_S, ControlPlaneConfig
from modelfleet.controlplane.state import FleetState, StaleReport, snapshot
from modelfleet.openai_api import json_response
from modelfleet.placement import Unplaceable, describe_need
from modelfleet.reconcile import plan, settling
from modelfleet.serving import Listener, run_service
from modelfleet.wire import AgentReport, RoutedModel

log = logging.getLogger("modelfleet.controlplane")


def _error(status: int, message: str) -> Response:
    return json_response({"error": message}, status)


class ControlPlane:
    """The control plane's services around one `FleetState`."""

    def __init__(self, config: ControlPlaneConfig, catalog: Catalog) -> None:
        self.config = config
        self.state = FleetState(catalog, stale_after=config.node_stale_after)
        self.started_at = time.monotonic()
        self.settle_for = config.settle_for or DEFAULT_SETTLE_FOR_S
        self._wake = asyncio.Event()
        self._published: list[RoutedModel] | None = None
        self._routing_version = 0
        self._http = httpx.AsyncClient(timeout=5)

    # -- agent API -----------------------------------------------------------------------

    async def report(self, request: Request) -> Response:
        token = self.config.agent_token
        if token is not None and request.headers.get("authorization") != f"Bearer {token}":
            return _error(401, "missing or wrong agent token")
        body = await request.body()
        if len(body) > self.config.max_report_bytes:
            return _error(
                413, f"report of {len(body)} bytes exceeds {self.config.max_report_bytes}"
            )
        try:
            report = AgentReport.model_validate_json(body)
        except ValidationError as exc:
            return _error(400, f"malformed report: {exc.error_count()} problem(s): {exc}")
        try:
            changed = self.state.take_report(report, time.monotonic())
        except StaleReport as exc:
            return _error(409, str(exc))
        if changed:
            self._wake.set()
        assignment = self.state.assignment(report.node)
        return Response(assignment.model_dump_json(), media_type="application/json")

    # -- admin API -----------------------------------------------------------------------

    def _admin_ok(self, request: Request) -> bool:
        return request.headers.get("authorization") == f"Bearer {self.config.admin_token}"

    async def admin(self, request: Request) -> Response:
        if not self._admin_ok(request):
            return _error(401, "missing or wrong admin token")
        handler = {
            "/v1/nodes": self.nodes_json,
            "/v1/replicas": self.replicas_json,
            "/v1/catalog": self.catalog_json,
            "/v1/routing": self.routing_json,
        }[request.url.path]
        return json_response(handler())

    def nodes_json(self) -> dict[str, Any]:
        now = time.monotonic()
        used = self.state.used_slots()
        nodes = []
        for node in self.state.node_list():
            gpus = []
            for g in node.gpus:
                gpus.append(
                    {
                        "index": g.index,
                        "model": g.model,
                        "memory_total": g.memory_total,
                        "memory_free": g.memory_free,
                        "healthy": g.healthy,
                        "reason": g.reason,
                        "in_use": (node.name, g.index) in used,
                    }
                )
            shards = self.state.nodes[node.name].report.shards
            nodes.append(
                {
                    "name": node.name,
                    "ready": node.is_ready(now, self.state.stale_after),
                    "mark": node.mark.value,
                    "address": node.address,
                    "labels": dict(node.labels),
                    "last_report_s": round(now - (node.last_report or now), 1),
                    "gpus": gpus,
                    "shards": len(shards),
                }
            )
        return {"nodes": nodes}

    async def explain(self, request: Request) -> Response:
        if not self._admin_ok(request):
            return _error(401, "missing or wrong admin token")
        model = request.path_params["model"]
        answer = self.state.explain(model, time.monotonic())
        if answer is None:
            known = ", ".join(m.name for m in self.state.catalog.models) or "none"
            return _error(404, f"model {model!r} is not in the current catalog (models: {known})")
        spec = self.state.catalog.get(model)
        pending = self.state.pending_for(model)
        data: dict[str, Any] = {
            "model": model,
            "needs": describe_need(spec) if spec else "",
            "pending": pending.count if pending else 0,
            "pending_reason": pending.explanation.summary if pending else "",
        }
        if isinstance(answer, Unplaceable):
            data.update(placeable=False, summary=answer.summary, placement=[])
        else:
            where = ", ".join(f"{s.node} gpus {list(s.gpus)}" for s in answer.shards)
            data.update(placeable=True, summary=f"the next replica would go to {where}")
            data["placement"] = [{"node": s.node, "gpus": list(s.gpus)} for s in answer.shards]
        data["nodes"] = [asdict(v) for v in answer.verdicts]
        return json_response(data)

    def replicas_json(self) -> dict[str, Any]:
        replicas = [asdict(v) for v in self.state.replica_views()]
        pending = []
        for p in self.state.pending:
            spec = self.state.catalog.get(p.model)
            pending.append(
                {
                    "model": p.model,
                    "count": p.count,
                    "reason": p.explanation.summary,
                    "needs": describe_need(spec) if spec else "",
                    "nodes": [asdict(v) for v in p.explanation.verdicts],
                }
            )
        return {"replicas": replicas, "pending": pending}

    def catalog_json(self) -> dict[str, Any]:
        c = self.state.catalog
        return {"version": c.version, "digest": c.digest, **c.to_dict()}

    def routing_json(self) -> dict[str, Any]:
        models = self._published or []
        return {"version": self._routing_version, "models": [m.model_dump() for m in models]}

    # -- reconcile and publish -----------------------------------------------------------

    def settling(self, now: float) -> bool:
        return settling(
            now,
            self.started_at,
            self.settle_for,
            self.config.known_nodes,
            self.state.nodes.keys(),
        )

    def reconcile_once(self, now: float) -> None:
        """One pass: plan against what is known, carry the plan out (unless settling)."""
        if self.settling(now):
            return
        s = self.state
        decided = plan(
            s.catalog,
            [r.replica for r in s.replicas.values()],
            s.serving(),
            s.node_list(),
            s.busy_slots(),
            now,
            s.stale_after,
        )
        for stop in decided.stop:
            log.info("stopping replica %s: %s", stop.replica_id, stop.reason)
        for replica in s.apply(decided, now):
            where = ", ".join(f"{p.node}{list(p.gpus)}" for p in replica.shards)
            log.info("placed %s (%s) on %s", replica.id, replica.model, where)
        for p in decided.pending:
            log.info("%d replica(s) of %s pending: %s", p.count, p.model, p.explanation.summary)

    async def reconcile_loop(self) -> None:
        while True:
            self._wake.clear()
            self.reconcile_once(time.monotonic())
            await self.publish()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.reconcile_interval)

    async def publish(self, force: bool = False) -> None:
        """Push the routing table to every router when it changed (or when forced)."""
        models = self.state.routing_models()
        if models != self._published:
            self._published = models
            self._routing_version = max(self._routing_version + 1, int(time.time() * 1000))
        elif not force:
            return
        snap = snapshot(models, self._routing_version, self.state.catalog.version)
        body = snap.model_dump_json()
        await asyncio.gather(*(self._push(r.url, r.token, body) for r in self.config.routers))

    async def _push(self, url: str, token: str, body: str) -> None:
        try:
            response = await self._http.put(
                f"{url}/v1/routing",
                content=body,
                headers={"authorization": f"Bearer {token}", "content-type": "application/json"},
            )
        except httpx.HTTPError as exc:
            log.warning("push to router %s failed: %s", url, exc)
            return
        if response.status_code not in (200, 409):
            log.warning("router %s refused the push: %s", url, response.text[:200])

    async def push_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.push_interval)
            await self.publish(force=True)

    async def close(self) -> None:
        await self._http.aclose()


def create_apps(cp: ControlPlane) -> tuple[Starlette, Starlette]:
    """The agent API app and the admin API app."""
    agent = Starlette(routes=[Route("/v1/report", cp.report, methods=["POST"])])
    admin_paths = ("/v1/nodes", "/v1/replicas", "/v1/catalog", "/v1/routing")
    admin = Starlette(
        routes=[
            *(Route(p, cp.admin) for p in admin_paths),
            Route("/v1/explain/{model:path}", cp.explain),
        ]
    )
    return agent, admin


def load_catalog(path: Path) -> Catalog:
    """Read and validate a catalog file; raises CatalogInvalid or OSError."""
    return Catalog.from_yaml(path.read_text(), source=str(path))


async def serve(config: ControlPlaneConfig, catalog: Catalog, ready_file: Path | None) -> None:
    """Run the control plane until SIGINT/SIGTERM. Engines and agents keep running."""
    cp = ControlPlane(config, catalog)
    agent_app, admin_app = create_apps(cp)
    listeners = [
        Listener("agent", agent_app, config.host, config.agent_port),
        Listener("admin", admin_app, config.host, config.admin_port),
    ]
    total = sum(m.replicas for m in catalog.models)
    log.info(
        "catalog %s: %d model(s), %d replica(s); settling up to %.0fs",
        catalog.digest,
        len(catalog.models),
        total,
        cp.settle_for,
    )
    await run_service(
        listeners,
        ready_file=ready_file,
        loops=[cp.reconcile_loop, cp.push_loop],
        on_stop=cp.close,
    )
