"""Who answers what: the leader answers everything; a follower answers reads of the store
and sends the rest to the leader (or refuses, naming it)."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

from fastapi import Request
from starlette.responses import Response

from modelfleet.controlplane.admin_api import once
from modelfleet.controlplane.admin_api.shared import error
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.messages import admin
from modelfleet.store import OutcomeUnknown, StoreError

# Reads of what runs, which only the leader learns (from agents' reports): a follower
# redirects them to the leader. Everything else is read from the store, by any control plane.
LIVE_STATE = ("/v1/nodes", "/v1/replicas", "/v1/explain/", "/v1/routing", "/v1/logs/")
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

Next = Callable[[Request], Awaitable[Response]]


def only_the_leader_writes(cp: ControlPlane) -> Callable[[Request, Next], Awaitable[Response]]:
    """The admin app's middleware for `cp`."""

    async def middleware(request: Request, call_next: Next) -> Response:
        """A change made through a follower would race the leader's: redirected to the leader
        (307, the same method and body), or refused naming it while it has not said where it
        is reached, and for the dashboard (its sign-in cookie is this origin's). Reads of
        what runs (LIVE_STATE) are redirected to the leader too."""
        path = request.url.path
        reading = request.method in READ_METHODS
        rid = None if reading else request.headers.get(admin.IDEMPOTENCY_KEY)
        if rid is not None and rid in cp.calls.in_flight:  # whoever leads now: not known yet
            request.state.request_id = rid
            earlier = "an earlier attempt of this request has had no answer from the store"
            return once.unknown(request, OutcomeUnknown(earlier))
        if cp.acting():
            return await call_next(request)
        if reading and not path.startswith(LIVE_STATE):
            # A follower answers what the store holds now. While the store cannot be read,
            # nobody can change it either: what this one read last is answered. Status
            # reads nothing of it, and answers at once whatever the store does.
            if path != "/v1/status":
                with contextlib.suppress(StoreError):
                    await cp.read_desired()
            return await call_next(request)
        if path in ("/ui/login", "/ui/logout"):
            return await call_next(request)
        url = cp.leadership.leader_url("admin")
        if url is not None and not path.startswith("/ui/"):
            location = url.rstrip("/") + path
            if request.url.query:
                location += "?" + request.url.query
            why = "what runs is the leader's" if reading else f"the leader is {url}"
            said = admin.ErrorAnswer(error=f"this control plane follows; {why}")
            return error(307, said, {"location": location})
        if reading:  # what runs, with no leader to ask: this one's own (empty) view
            return await call_next(request)
        if cp.leadership.refused:
            why = f"this control plane {cp.leadership.refused}"
            return error(503, admin.ErrorAnswer(error=why))
        store = cp.calls.problem() if cp.calls.outage is not None else cp.leadership.problem
        if store:  # it cannot renew its lease: nobody can change anything now
            why = f"this control plane cannot take changes now: {store}"
            return error(503, admin.ErrorAnswer(error=why), {"retry-after": "1"})
        lapsed = cp.leadership.lapsed()
        if lapsed is not None:
            answer = admin.ErrorAnswer(error=f"{lapsed}; send the change again shortly")
            return error(503, answer, {"retry-after": "1"})
        leader = cp.leadership.leader or "none yet"
        answer = admin.ErrorAnswer(
            error=f"this control plane follows (the leader is {leader}"
            + (f" at {url}" if url else "")
            + "); send changes to the leader"
        )
        return error(503, answer, {"retry-after": "1"})

    return middleware
