"""The control plane's Prometheus metrics (`controlplane/metrics.py`), behind the admin token
or the metrics token. A plain route, out of the API's document: its answer is text."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response

from modelfleet.controlplane.admin_api.shared import error
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.http.web import bearer_matches
from modelfleet.messages import admin


def endpoint(cp: ControlPlane) -> Callable[[Request], Awaitable[Response]]:
    async def metrics(request: Request) -> Response:
        given = request.headers.get("authorization")
        tokens = (cp.config.admin_token, cp.config.metrics_token)
        if not any(bearer_matches(given, token) for token in tokens):
            return error(401, admin.ErrorAnswer(error="missing or wrong admin or metrics token"))
        return Response(generate_latest(cp.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return metrics
