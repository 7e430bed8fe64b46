"""The control plane: the agent API, the admin API, the reconcile loop and the publisher.

A thin shell around `FleetState`, the `CatalogKeeper` and the pure planner. Two listeners on
their own ports: the agent API (`POST /v1/report`, agent token) and the admin API (nodes,
replicas, explain, catalog; admin token). The reconcile loop runs every `reconcile_interval`
seconds and at once after a report or a catalog swap that changed something. Each pass that
changes the routing table pushes one whole snapshot to every router, and the current one is
re-pushed every `push_interval` seconds so a router that restarted or missed a push heals.
A replica taken out of service is stopped only after every router has confirmed a table
without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
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

from modelfleet.catalog import Catalog, CatalogInvalid
from modelfleet.controlplane.catalogs import API_SOURCE, CatalogKeeper
from modelfleet.controlplane.config import DEFAULT_SETTLE_FOR_S, STORE_FILE, ControlPlaneConfig
from modelfleet.controlplane.state import FleetState, NodeMark, StaleReport, snapshot
from modelfleet.fleet import Mark, Replica
from modelfleet.openai_api import json_response
from modelfleet.placement import Unplaceable, describe_need
from modelfleet.reconcile import Preview, plan, preview, settling
from modelfleet.serving import Listener, run_service
from modelfleet.store import StoredMark
from modelfleet.store.sqlite import SqliteStore
from modelfleet.wire import AgentReport, RoutedModel

log = logging.getLogger("modelfleet.controlplane")


def _error(status: int, message: str, **extra: Any) -> Response:
    return json_response({"error": message, **extra}, status)


def _replica_json(replica: Replica) -> dict[str, Any]:
    return {
        "id": replica.id,
        "model": replica.model,
        "shards": [{"node": s.node, "gpus": list(s.gpus)} for s in replica.shards],
    }


def preview_json(p: Preview) -> dict[str, Any]:
    """A catalog preview as the admin API answers it."""
    return {
        "steps": [
            {"step": s.step, "action": s.action, **_replica_json(s.replica), "reason": s.reason}
            for s in p.steps
        ],
        "pending": [
            {"model": x.model, "count": x.count, "reason": x.explanation.summary} for x in p.pending
        ],
    }


class ControlPlane:
    """The control plane's services around one `FleetState` and one `CatalogKeeper`."""

    def __init__(
        self,
        config: ControlPlaneConfig,
        catalogs: CatalogKeeper,
        http: httpx.AsyncClient | None = None,  # how it reaches routers; tests pass a mock
    ) -> None:
        self.config = config
        self.catalogs = catalogs
        self.state = FleetState(stale_after=config.node_stale_after)
        self.started_at = time.monotonic()
        self.settle_for = config.settle_for or DEFAULT_SETTLE_FOR_S
        self._wake = asyncio.Event()
        self._published: tuple[int, list[RoutedModel]] | None = None
        self._routing_version = 0
        self._acked: dict[str, int] = {}  # router url -> newest routing version it holds
        self._http = http or httpx.AsyncClient(timeout=5)
        self._file_error = ""
        self.store = catalogs.store
        self._load_marks()

    def _load_marks(self) -> None:
        """Marks persist: take them from the store, deadlines moved onto the monotonic clock."""
        wall, mono = time.time(), time.monotonic()
        for m in self.store.marks():
            deadline = None if m.drain_deadline is None else mono + (m.drain_deadline - wall)
            self.state.set_mark(m.node, NodeMark(Mark(m.mark), deadline))

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
        catalog = self.catalogs.current
        try:
            changed = self.state.take_report(report, catalog, time.monotonic())
        except StaleReport as exc:
            return _error(409, str(exc))
        if changed:
            self._wake.set()
        assignment = self.state.assignment(report.node, catalog)
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
        on_node: dict[str, int] = {}
        for replica in self.state.planned():
            for node_name in {s.node for s in replica.shards}:
                on_node[node_name] = on_node.get(node_name, 0) + 1
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
            grace_left = None
            if node.mark is Mark.DRAINING and node.drain_deadline is not None:
                grace_left = round(max(0.0, node.drain_deadline - now), 1)
            nodes.append(
                {
                    "name": node.name,
                    "ready": node.is_ready(now, self.state.stale_after),
                    "mark": node.mark.value,
                    "drain_grace_left_s": grace_left,
                    "address": node.address,
                    "labels": dict(node.labels),
                    "last_report_s": round(now - (node.last_report or now), 1),
                    "gpus": gpus,
                    "shards": len(shards),
                    "replicas": on_node.get(node.name, 0),
                }
            )
        return {"nodes": nodes}

    async def mark_node(self, request: Request) -> Response:
        """Cordon, drain or uncordon a node: `{"mark": "cordoned" | "draining" | "none"}`, and
        for a drain optionally `"grace_s"` (default: the config's drain_grace; 0: no bound)."""
        if not self._admin_ok(request):
            return _error(401, "missing or wrong admin token")
        name = request.path_params["node"]
        try:
            body = json.loads(await request.body())
            mark = Mark(body["mark"])
            grace = float(body.get("grace_s", self.config.drain_grace))
            if grace < 0:
                raise ValueError("grace_s must not be negative")
        except (ValueError, KeyError, TypeError) as exc:
            marks = ", ".join(m.value for m in Mark)
            return _error(
                400, f"send {{'mark': one of {marks}, 'grace_s': seconds}}: {exc!r} is wrong"
            )
        if name not in self.state.nodes:
            known = ", ".join(sorted(self.state.nodes)) or "none has reported yet"
            return _error(404, f"no node {name!r} has reported (nodes: {known})")
        was = self.state.marks.get(name)
        wall, mono = time.time(), time.monotonic()
        deadline = mono + grace if mark is Mark.DRAINING and grace > 0 else None
        if mark is Mark.NONE:
            self.store.clear_mark(name)
        else:
            wall_deadline = None if deadline is None else wall + grace
            self.store.set_mark(StoredMark(name, mark.value, wall, wall_deadline))
        self.state.set_mark(name, NodeMark(mark, deadline))
        self._wake.set()
        log.info("node %s marked %s (was %s)", name, mark.value, was.mark.value if was else "none")
        s = self.state
        moves = preview(
            self.catalogs.current, s.planned(), s.node_list(), s.busy_slots(), mono, s.stale_after
        )
        return json_response(
            {
                "node": name,
                "mark": mark.value,
                "was": was.mark.value if was else Mark.NONE.value,
                "drain_grace_s": grace if mark is Mark.DRAINING and grace > 0 else None,
                **preview_json(moves),
            }
        )

    async def explain(self, request: Request) -> Response:
        if not self._admin_ok(request):
            return _error(401, "missing or wrong admin token")
        model = request.path_params["model"]
        catalog = self.catalogs.current
        answer = self.state.explain(catalog, model, time.monotonic())
        spec = catalog.get(model)
        if answer is None or spec is None:
            known = ", ".join(m.name for m in catalog.models) or "none"
            return _error(404, f"model {model!r} is not in the current catalog (models: {known})")
        pending = self.state.pending_for(model)
        data: dict[str, Any] = {
            "model": model,
            "needs": describe_need(spec),
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
        catalog = self.catalogs.current
        replicas = []
        for view in self.state.replica_views():
            data = asdict(view)
            for shard in data["shards"]:
                del shard["log_tail"]  # `replicas/ID` has it; a list of every tail is too much
            replicas.append(data)
        pending = []
        for p in self.state.pending:
            spec = catalog.get(p.model)
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

    async def replica(self, request: Request) -> Response:
        """One replica with every shard's state, error, restarts, backoff and log tail."""
        if not self._admin_ok(request):
            return _error(401, "missing or wrong admin token")
        rid = request.path_params["replica"]
        record = self.state.replicas.get(rid)
        if record is None:
            retired = self.state.retired.get(rid)
            if retired is not None:
                return _error(404, f"replica {rid!r} was stopped: {retired[0]}")
            known = ", ".join(sorted(self.state.replicas)) or "none"
            return _error(404, f"no replica {rid!r} (replicas: {known})")
        return json_response(asdict(self.state.replica_view(record)))

    def catalog_json(self) -> dict[str, Any]:
        current = self.catalogs.current_info
        c = current.catalog
        rejected = self.catalogs.last_rejection()
        return {
            "version": c.version,
            "digest": c.digest,
            "applied_at": current.applied_at,
            "source": current.source,
            **c.to_dict(),
            "last_rejection": asdict(rejected) if rejected else None,
        }

    async def catalog_history(self, request: Request) -> Response:
        if not self._admin_ok(request):
            return _error(401, "missing or wrong admin token")
        raw = request.query_params.get("limit", "20")
        if not raw.isdigit() or int(raw) < 1:
            return _error(400, f"limit must be a positive integer, got {raw!r}")
        versions = [
            {
                "version": v.version,
                "digest": v.digest,
                "applied_at": v.applied_at,
                "source": v.source,
                "models": [m["name"] for m in v.body["models"]],
            }
            for v in self.catalogs.history(int(raw))
        ]
        return json_response({"versions": versions})

    async def put_catalog(self, request: Request) -> Response:
        """Apply the catalog in the body (YAML or JSON), or with `?dry_run=true` only say what
        applying it would do. An invalid catalog changes nothing and gets 422 with every problem.
        """
        if not self._admin_ok(request):
            return _error(401, "missing or wrong admin token")
        body = await request.body()
        if len(body) > self.config.max_catalog_bytes:
            limit = self.config.max_catalog_bytes
            return _error(413, f"catalog of {len(body)} bytes exceeds {limit}")
        dry_run = request.query_params.get("dry_run", "").lower() in ("1", "true", "yes")
        text = body.decode(errors="replace")
        if dry_run:
            current = self.catalogs.current
            try:
                candidate = self.catalogs.validate(text, API_SOURCE)
            except CatalogInvalid as exc:
                return self._invalid(exc)
            changed = candidate.digest != current.digest
            steps = preview_json(self._preview(candidate))
            return json_response(
                {"dry_run": True, "changed": changed, "version": current.version, **steps}
            )
        try:
            applied = self.catalogs.apply(text, API_SOURCE, time.time())
        except CatalogInvalid as exc:
            return self._invalid(exc)
        if applied.changed:
            self._wake.set()
        # No pass has run since the swap (nothing awaited), so this is what the next ones do.
        steps = preview_json(self._preview(applied.catalog))
        return json_response(
            {
                "dry_run": False,
                "changed": applied.changed,
                "version": applied.catalog.version,
                "previous_version": applied.previous.version,
                "digest": applied.catalog.digest,
                **steps,
            }
        )

    def _invalid(self, exc: CatalogInvalid) -> Response:
        problems = [asdict(p) for p in exc.problems]
        message = f"the catalog is invalid ({len(problems)} problem(s)); nothing was changed"
        return _error(422, message, problems=problems)

    def _preview(self, catalog: Catalog) -> Preview:
        s = self.state
        now = time.monotonic()
        return preview(catalog, s.planned(), s.node_list(), s.busy_slots(), now, s.stale_after)

    def routing_json(self) -> dict[str, Any]:
        catalog_version, models = self._published or (0, [])
        return {
            "version": self._routing_version,
            "catalog_version": catalog_version,
            "models": [m.model_dump() for m in models],
            "routers": dict(self._acked),
        }

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
        catalog = self.catalogs.current
        failed = {}
        for rid, (node, why) in s.failing(self.config.max_failures).items():
            s.keep_off(s.replicas[rid].replica.model, node, why, now + self.config.failure_avoid)
            failed[rid] = why
        decided = plan(
            catalog,
            s.planned(),
            s.serving(),
            s.node_list(),
            s.busy_slots(),
            now,
            s.stale_after,
            failed,
            s.avoiding(now),
            self.config.node_lost_after,
        )
        for stop in decided.stop:
            log.info("retiring replica %s: %s", stop.replica_id, stop.reason)
        before = s.pending
        for replica in s.apply(decided, catalog, now, self.config.retire_timeout):
            where = ", ".join(f"{p.node}{list(p.gpus)}" for p in replica.shards)
            log.info("placed %s (%s) on %s", replica.id, replica.model, where)
        # Pending replicas are logged when they change, not on every pass.
        was = {p.model: p.count for p in before}
        for p in decided.pending:
            if was.get(p.model) != p.count:
                log.info("%d replica(s) of %s pending: %s", p.count, p.model, p.explanation.summary)

    def release_retired(self, now: float) -> None:
        """Let go of the retiring replicas every router has stopped routing to."""
        routers = self.config.routers
        routed = min((self._acked.get(r.url, -1) for r in routers), default=self._routing_version)
        for rid, why in self.state.release(routed, now):
            log.info("replica %s is out of every routing table; stopping it (%s)", rid, why)

    async def reconcile_loop(self) -> None:
        while True:
            self._wake.clear()
            self.reconcile_once(time.monotonic())
            await self.publish()
            self.release_retired(time.monotonic())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.reconcile_interval)

    async def publish(self, force: bool = False) -> None:
        """Push the routing table to every router when it changed (or when forced), and again
        to each router that has not taken the current one (it was down, or refused it).

        Nothing is pushed while settling: the table is still empty of what agents have yet to
        report, and a router keeps serving from the one it holds.
        """
        if self.settling(time.monotonic()):
            return
        catalog = self.catalogs.current
        published = (catalog.version, self.state.routing_models(catalog))
        if published != self._published:
            self._published = published
            self._routing_version = max(self._routing_version + 1, int(time.time() * 1000))
            force = True
        self.state.mark_unrouted(self._routing_version)
        routers = [
            r
            for r in self.config.routers
            if force or self._acked.get(r.url, -1) < self._routing_version
        ]
        if not routers:
            return
        snap = snapshot(published[1], self._routing_version, catalog.version)
        body = snap.model_dump_json()
        await asyncio.gather(*(self._push(r.url, r.token, body) for r in routers))

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
            return
        try:
            held = int(response.json()["version"])
        except (ValueError, KeyError, TypeError):
            log.warning("router %s answered the push with no version", url)
            return
        self._acked[url] = max(held, self._acked.get(url, -1))

    async def push_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.push_interval)
            await self.publish(force=True)

    async def catalog_loop(self) -> None:
        """Apply the catalog file whenever its content changes."""
        while True:
            await asyncio.sleep(self.config.catalog_poll_interval)
            try:
                applied = self.catalogs.check_file(time.time())
                self._file_error = ""
            except OSError as exc:
                if str(exc) != self._file_error:  # once per distinct error, not every poll
                    self._file_error = str(exc)
                    log.warning("cannot read the catalog file: %s; the current one stays", exc)
                continue
            if applied is not None and applied.changed:
                self._wake.set()

    async def close(self) -> None:
        await self._http.aclose()
        self.catalogs.store.close()


def create_apps(cp: ControlPlane) -> tuple[Starlette, Starlette]:
    """The agent API app and the admin API app."""
    agent = Starlette(routes=[Route("/v1/report", cp.report, methods=["POST"])])
    admin_paths = ("/v1/nodes", "/v1/replicas", "/v1/catalog", "/v1/routing")
    admin = Starlette(
        routes=[
            *(Route(p, cp.admin) for p in admin_paths),
            Route("/v1/catalog", cp.put_catalog, methods=["PUT"]),
            Route("/v1/catalog/history", cp.catalog_history),
            Route("/v1/replicas/{replica:path}", cp.replica),
            Route("/v1/nodes/{node}/mark", cp.mark_node, methods=["POST"]),
            Route("/v1/explain/{model:path}", cp.explain),
        ]
    )
    return agent, admin


def open_catalogs(config: ControlPlaneConfig) -> CatalogKeeper:
    """The store in the state dir and the catalog to start from (see `CatalogKeeper.start`).

    Raises CatalogInvalid, StoreError or OSError when there is no catalog to start from.
    """
    store = SqliteStore(config.state_dir / STORE_FILE)
    keeper = CatalogKeeper(store, config.catalog)
    keeper.start(time.time())
    return keeper


async def serve(
    config: ControlPlaneConfig, catalogs: CatalogKeeper, ready_file: Path | None
) -> None:
    """Run the control plane until SIGINT/SIGTERM. Engines and agents keep running."""
    cp = ControlPlane(config, catalogs)
    agent_app, admin_app = create_apps(cp)
    listeners = [
        Listener("agent", agent_app, config.host, config.agent_port),
        Listener("admin", admin_app, config.host, config.admin_port),
    ]
    catalog = catalogs.current
    total = sum(m.replicas for m in catalog.models)
    log.info(
        "catalog version %d: %d model(s), %d replica(s); settling up to %.0fs",
        catalog.version,
        len(catalog.models),
        total,
        cp.settle_for,
    )
    await run_service(
        listeners,
        ready_file=ready_file,
        loops=[cp.reconcile_loop, cp.push_loop, cp.catalog_loop],
        on_stop=cp.close,
    )
