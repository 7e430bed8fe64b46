"""The agent API: `POST /v1/report`. An agent sends its node's whole state and gets back the
node's whole desired shard set (level-triggered: a lost or repeated report heals on the next)."""

from __future__ import annotations

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelfleet.controlplane.plane import ControlPlane
from modelfleet.controlplane.state import StaleReport
from modelfleet.web import JSON, bearer_matches, error_response, read_at_most
from modelfleet.wire import AgentReport


def create_agent_app(cp: ControlPlane) -> Starlette:
    """The agent API of `cp`, checked with its agent token (none configured: open)."""

    async def report(request: Request) -> Response:
        token = cp.config.agent_token
        if token is not None and not bearer_matches(request.headers.get("authorization"), token):
            return error_response(401, "missing or wrong agent token")
        limit = cp.config.max_report_bytes
        body = await read_at_most(request, limit)
        if body is None:
            return error_response(413, f"a report may have at most {limit} bytes")
        try:
            sent = AgentReport.model_validate_json(body)
        except ValidationError as exc:
            return error_response(400, f"malformed report: {exc.error_count()} problem(s): {exc}")
        catalog = cp.catalogs.current
        try:
            changed = cp.state.take_report(sent, catalog, cp.clock.monotonic())
        except StaleReport as exc:
            return error_response(409, str(exc))
        if changed:
            cp.wake()
        assignment = cp.state.assignment(sent.node, catalog)
        return Response(assignment.model_dump_json(), media_type=JSON)

    return Starlette(routes=[Route("/v1/report", report, methods=["POST"])])
