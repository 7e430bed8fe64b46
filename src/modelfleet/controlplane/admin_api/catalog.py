"""The catalog: the current one, its history, and applying another (or previewing it)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from modelfleet.controlplane import views
from modelfleet.controlplane.admin_api import once
from modelfleet.controlplane.admin_api.shared import Refused, errors
from modelfleet.controlplane.catalog_file import applied_event, refused_event
from modelfleet.controlplane.catalogs import API_SOURCE, Applied
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.core.catalog import Catalog, CatalogInvalid
from modelfleet.http.web import read_at_most
from modelfleet.messages import admin
from modelfleet.store import AlreadyMade, StoredRequest

ROUTE = "PUT /v1/catalog"
_CATALOG_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/yaml": {"schema": {"type": "string"}},
            "application/json": {"schema": {"type": "object"}},
        },
        "description": "A catalog file: `models:` and a list of models (YAML or JSON).",
    }
}


def routes(cp: ControlPlane) -> APIRouter:
    api = APIRouter()

    @api.get("/v1/catalog", responses=errors())
    async def catalog() -> admin.CatalogAnswer:
        """The current catalog, its version, and the last rejected attempt."""
        return views.catalog(cp.catalogs)

    @api.get("/v1/catalog/history", responses=errors(400))
    async def catalog_history(
        limit: Annotated[int, Query(ge=1, le=admin.MAX_HISTORY)] = 20,
    ) -> admin.CatalogHistory:
        """The last applied catalog versions, newest first."""
        return views.history(await cp.calls(cp.catalogs.history, limit))

    async def changes(
        candidate: Catalog,
    ) -> tuple[list[admin.AdapterChange], list[admin.Step], list[admin.PendingStep]]:
        """What applying `candidate` does: adapters loaded and unloaded, replicas moved and
        pending. The preview takes the table before anything is awaited: what the next
        passes do."""
        demand = cp.term.adapter_demand(candidate)
        adapters = views.adapter_changes(cp.state, candidate, demand, cp.replica_loads())
        moves, pending = views.steps(await cp.preview(candidate))
        return adapters, moves, pending

    def made_before(made: StoredRequest) -> Response:
        """A catalog applied by an earlier attempt of the request: what it applied."""
        version = int(made.outcome["version"])
        answer = admin.CatalogChange(
            dry_run=False,
            changed=True,
            version=version,
            previous_version=version - 1,
            digest=made.outcome.get("digest"),
            steps=[],
            pending=[],
        )
        return once.replayed(ROUTE, made, answer)

    def landed(applied: Applied) -> None:
        """What follows an apply: its event, and a pass if it changed the catalog."""
        applied_event(cp.events, applied, API_SOURCE)
        if applied.changed:
            cp.wake()

    @api.put(
        "/v1/catalog",
        responses=errors(400, 413, 422, 503),
        openapi_extra=_CATALOG_BODY,
        response_model=admin.CatalogChange,
    )
    async def put_catalog(
        request: Request, dry_run: bool = False
    ) -> admin.CatalogChange | Response:
        """Apply the catalog in the body, or with `dry_run` only say what applying it would
        do. An invalid catalog changes nothing and gets 422 with every problem. Made at most
        once per `Idempotency-Key`."""
        limit = cp.config.max_catalog_bytes
        body = await read_at_most(request, limit)
        if body is None:
            raise Refused.because(413, f"a catalog may have at most {limit} bytes")
        text = body.decode(errors="replace")
        current = cp.catalogs.current
        try:
            if dry_run:
                candidate = cp.catalogs.validate(text, API_SOURCE)
                adapters, moves, pending = await changes(candidate)
                return admin.CatalogChange(
                    dry_run=True,
                    changed=candidate.digest != current.digest,
                    version=current.version,
                    steps=moves,
                    pending=pending,
                    adapters=adapters,
                )
            note = once.begin(cp, request, ROUTE)
            now = cp.clock.time()
            applied = await cp.calls.change(
                lambda: cp.catalogs.apply(text, API_SOURCE, now, note), note.id, landed
            )
        except AlreadyMade as exc:
            return made_before(exc.request)
        except CatalogInvalid as exc:
            if not dry_run:
                refused_event(cp.events, [str(p) for p in exc.problems], API_SOURCE)
            raise Refused(422, views.refused(exc)) from None
        landed(applied)
        if not applied.changed and (made := await once.earlier(cp, request)) is not None:
            return made_before(made)  # the same catalog: applied by an earlier attempt
        adapters, moves, pending = await changes(applied.catalog)
        return admin.CatalogChange(
            dry_run=False,
            changed=applied.changed,
            version=applied.catalog.version,
            previous_version=applied.previous.version,
            digest=applied.catalog.digest,
            steps=moves,
            pending=pending,
            adapters=adapters,
        )

    return api
