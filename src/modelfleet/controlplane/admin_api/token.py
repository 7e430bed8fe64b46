"""Who may ask: the admin token, checked before anything else is done with a request.

It runs before the follower's middleware (`follower.py`), so that a request without the token
gets nothing of a follower either: no read of the store, no word of where the leader is.
`/metrics` takes the admin token or the metrics token. Not behind it: the dashboard (`/ui`,
which signs its browsers in by itself) and the API's document (`/openapi.json`).

A wrong token is counted per source address (`doors.py`, one throttle with the dashboard's
sign-in): past the free failures the address waits, and what it sends meanwhile is refused
unheard (429 with Retry-After), with one log line per wait. A request with no token at all
guesses nothing and is refused (401) without being counted.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request
from starlette.responses import Response

from modelfleet.controlplane.admin_api.shared import error
from modelfleet.controlplane.doors import retry_after
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.http.web import bearer_matches
from modelfleet.messages import admin

OPEN_PATHS = ("/ui/", "/openapi.json")

Next = Callable[[Request], Awaitable[Response]]


def token_first(cp: ControlPlane) -> Callable[[Request, Next], Awaitable[Response]]:
    """The admin app's outermost middleware for `cp`."""

    async def middleware(request: Request, call_next: Next) -> Response:
        path = request.url.path
        if path == "/ui" or path.startswith(OPEN_PATHS):
            return await call_next(request)
        config = cp.config
        metrics = path == "/metrics"
        tokens = (config.admin_token, config.metrics_token) if metrics else (config.admin_token,)
        what = "admin or metrics token" if metrics else "admin token"
        given = request.headers.get("authorization")
        if given is None:
            return error(401, admin.ErrorAnswer(error=f"missing or wrong {what}"))
        source = request.client.host if request.client else "?"
        taken = cp.doors.attempt("admin", source)
        if taken.wait > 0:
            wait = retry_after(taken)
            why = f"too many wrong admin tokens from {source}: try again in {wait}s"
            return error(429, admin.ErrorAnswer(error=why), {"retry-after": wait})
        if not any(bearer_matches(given, token) for token in tokens):
            cp.doors.failed("admin", source, f"a wrong {what} ({request.method} {path})", taken)
            return error(401, admin.ErrorAnswer(error=f"missing or wrong {what}"))
        cp.doors.succeeded("admin", source)
        return await call_next(request)

    return middleware
