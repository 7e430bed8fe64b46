"""The admin API: what operators (and `ctl`) read and change, behind the admin token.

One module per resource, each a FastAPI `APIRouter` over one `ControlPlane`; what they share
(the refusal, the error answer, bounded bodies) is `shared.py`, who answers what (the leader
everything, a follower reads of the store) is `follower.py`, and the admin token, checked
before anything else, `token.py`. Every request and answer is a
model of `modelfleet.messages.admin`; the document at `/openapi.json` describes them all.
Every error answer is an `ErrorAnswer` (`{"error": ...}`).

May import: the control plane's modules, the store's errors, the shared HTTP pieces and the
pure core; nothing imports it but the control plane's service.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.applications import Starlette
from starlette.responses import Response

from modelfleet.controlplane.admin_api import (
    catalog,
    events,
    follower,
    join_tokens,
    keys,
    logs,
    metrics,
    nodes,
    once,
    replicas,
    shared,
    status,
    token,
    usage,
)
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.messages.admin import ErrorAnswer
from modelfleet.store import OutcomeUnknown

RESOURCES = (status, catalog, nodes, replicas, keys, usage, join_tokens, events, logs)


def create_admin_app(cp: ControlPlane, dashboard: Starlette | None = None) -> FastAPI:
    """The admin API of `cp`, with the `dashboard` app at /ui when given."""

    app = FastAPI(
        title="modelfleet admin API",
        version="1",
        description="Nodes, replicas, placement, marks, the catalog and the client API keys of "
        "a modelfleet fleet. "
        "Send the admin token as `Authorization: Bearer TOKEN`.",
        docs_url=None,
        redoc_url=None,
    )
    routers = [resource.routes(cp) for resource in RESOURCES]
    shared.answer_errors(app, [route for router in routers for route in router.routes])

    @app.exception_handler(OutcomeUnknown)
    async def may_have_been_made(request: Request, exc: OutcomeUnknown) -> Response:
        """A store call with no outcome: a read changed nothing; a change may have been made."""
        if request.method in follower.READ_METHODS:
            answer = ErrorAnswer(error=f"{exc}; nothing was changed: try again")
            return shared.error(503, answer, {"retry-after": "1"})
        return once.unknown(request, exc)

    app.middleware("http")(follower.only_the_leader_writes(cp))
    app.middleware("http")(token.token_first(cp))  # the last added runs first: the token
    for router in routers:
        app.include_router(router)
    app.add_route("/metrics", metrics.endpoint(cp), methods=["GET"])
    if dashboard is not None:
        app.mount("/ui", dashboard)
    return app
