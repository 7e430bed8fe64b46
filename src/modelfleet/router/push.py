"""The router's push API, which only the control plane uses (admin token): a routing table
pushed whole (`PUT /v1/routing`), which table is held (`GET /v1/routing/held`), the table as
held without engines' keys (`GET /v1/routing`), the usage counted since the last batch
collected (`GET /v1/usage`, then `POST /v1/usage/ack`), the process's own metrics
(`GET /v1/metrics`: how the workers of one router sum theirs), and the load per model that
autoscaling follows (`GET /v1/load?wait=S`, a long poll of up to S seconds that answers at
once when a model with no replica gets a request, or one goes over its target or into a
burst).

Written once for both kinds of router process: a router (`Router`) answers from itself, the
parent of `workers: N` (`workers.py`) by passing each call on to every worker. Each is a
`PushTarget`; this module checks the token, reads and checks what is sent, and answers.
"""

from __future__ import annotations

import secrets
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelfleet.core.nesting import TooDeep, check_json
from modelfleet.http.web import JSON, bearer_matches
from modelfleet.http.web import error_response as web_error
from modelfleet.messages.wire import (
    ROUTER_RUN_HEADER,
    LoadReport,
    RoutingAck,
    RoutingSnapshot,
    UsageAck,
    UsageReport,
)

MAX_LOAD_WAIT_S = 10.0


class PushUnavailable(Exception):
    """The target cannot answer now (a worker is starting or did not answer): 503."""


class PushTarget(Protocol):
    """What the push API reads and changes."""

    async def take_table(self, snapshot: RoutingSnapshot, body: bytes) -> RoutingAck:
        """Hold `snapshot` (as sent: `body`) unless it is older than the one held."""
        ...

    async def held(self) -> RoutingAck:
        """Which table is held; `applied` false while none was pushed to this run."""
        ...

    async def metrics_text(self) -> bytes:
        """The Prometheus metrics of this router process (the parent of several workers:
        their sum)."""
        ...

    async def shown_table(self) -> bytes:
        """The table held, as JSON, without the engines' keys."""
        ...

    async def usage(self) -> UsageReport:
        """The usage batches not yet acknowledged."""
        ...

    async def load(self, wait: float) -> LoadReport:
        """The load per model, after up to `wait` seconds (at once when a model with no
        replica gets its first held request, or one goes over its target or into a burst)."""
        ...

    async def ack_usage(self, ack: UsageAck) -> None:
        """The control plane stored these batches: forget them."""
        ...


def create_push_app(target: PushTarget, token: str | None) -> Starlette:
    """The push API in front of `target`; every call needs `token` (none: every call is
    refused)."""

    def authorized(request: Request) -> Response | None:
        if bearer_matches(request.headers.get("authorization"), token):
            return None
        return web_error(401, "missing or wrong admin token")

    run = secrets.token_hex(8)  # this run of the process that serves the push API

    def ack_answer(ack: RoutingAck, status: int) -> Response:
        headers = {ROUTER_RUN_HEADER: run}
        return Response(ack.model_dump_json(), status_code=status, media_type=JSON, headers=headers)

    async def put_routing(request: Request) -> Response:
        if (refused := authorized(request)) is not None:
            return refused
        body = await request.body()
        try:
            check_json(body)
            snapshot = RoutingSnapshot.model_validate_json(body)
        except (ValidationError, TooDeep) as exc:
            return web_error(400, f"not a routing snapshot: {exc}")
        try:
            ack = await target.take_table(snapshot, body)
        except PushUnavailable as exc:
            return web_error(503, f"not every router worker took the table: {exc}")
        return ack_answer(ack, 200 if ack.applied else 409)

    async def get_held(request: Request) -> Response:
        if (refused := authorized(request)) is not None:
            return refused
        try:
            return ack_answer(await target.held(), 200)
        except PushUnavailable as exc:
            return web_error(503, f"a router worker did not answer: {exc}")

    async def get_routing(request: Request) -> Response:
        if (refused := authorized(request)) is not None:
            return refused
        try:
            return Response(await target.shown_table(), media_type=JSON)
        except PushUnavailable as exc:
            return web_error(503, str(exc))

    async def get_metrics(request: Request) -> Response:
        if (refused := authorized(request)) is not None:
            return refused
        try:
            text = await target.metrics_text()
        except PushUnavailable as exc:
            return web_error(503, str(exc))
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    async def get_usage(request: Request) -> Response:
        if (refused := authorized(request)) is not None:
            return refused
        return Response((await target.usage()).model_dump_json(), media_type=JSON)

    async def get_load(request: Request) -> Response:
        if (refused := authorized(request)) is not None:
            return refused
        try:
            wait = float(request.query_params.get("wait", "0"))
        except ValueError:
            return web_error(400, "wait must be a number of seconds")
        if not 0 <= wait <= MAX_LOAD_WAIT_S:
            return web_error(400, f"wait must be between 0 and {MAX_LOAD_WAIT_S:g} seconds")
        try:
            report = await target.load(wait)
        except PushUnavailable as exc:
            return web_error(503, str(exc))
        # Said only when it is news (several counts): a control plane from before it knew the
        # field still reads the load of a router of one count.
        left_out = {"limit_counts"} if report.limit_counts == 1 else None
        return Response(report.model_dump_json(exclude=left_out), media_type=JSON)

    async def ack_usage(request: Request) -> Response:
        if (refused := authorized(request)) is not None:
            return refused
        try:
            body = await request.body()
            check_json(body)
            ack = UsageAck.model_validate_json(body)
        except (ValidationError, TooDeep) as exc:
            return web_error(400, f"not a usage acknowledgement: {exc}")
        await target.ack_usage(ack)
        return Response(b'{"ok":true}', media_type=JSON)

    return Starlette(
        routes=[
            Route("/v1/routing", put_routing, methods=["PUT"]),
            Route("/v1/routing", get_routing, methods=["GET"]),
            Route("/v1/routing/held", get_held, methods=["GET"]),
            Route("/v1/usage", get_usage, methods=["GET"]),
            Route("/v1/load", get_load, methods=["GET"]),
            Route("/v1/metrics", get_metrics, methods=["GET"]),
            Route("/metrics", get_metrics, methods=["GET"]),  # where Prometheus looks
            Route("/v1/usage/ack", ack_usage, methods=["POST"]),
        ]
    )
