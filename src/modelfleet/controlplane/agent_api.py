"""The agent API.

`POST /v1/report`: an agent sends its node's whole state and gets back the node's whole
desired shard set (level-triggered: a lost or repeated report heals on the next).

`POST /v1/heartbeat`: while its report is unchanged, an agent sends only that it is alive and
which assignment it holds. The answer comes at once when the node's assignment is another;
otherwise it is held until the assignment may have changed or the heartbeat interval is up (a
long poll), so that an idle node costs one small request per interval and a new assignment
reaches it at once. Each is held for a random 75 to 100 % of the interval: agents that started
together would otherwise beat together for good (10,000 of them every 10 s held the event
loop for a second at a time), as Nomad staggers its heartbeat deadlines. A heartbeat the
control plane cannot place (it restarted, or the agent did) is refused with 409, and the agent
sends its whole report.

Both are served as bare ASGI, not through Starlette's routing and middleware: every node of
the fleet holds a heartbeat at all times, and what each one holds (coroutines, request
objects) is what the garbage collector scans and what a restart of 10,000 nodes pays for
(bench/controlplane_scale.py). Anything else goes to a Starlette app: 404, 405, lifespan.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from modelfleet.controlplane.plane import ControlPlane
from modelfleet.controlplane.records import ReportFirst, StaleReport
from modelfleet.web import bearer_matches, error_json, header, receive_at_most, send_json
from modelfleet.wire import AgentReport, Heartbeat, HeartbeatAnswer

MAX_HEARTBEAT_BYTES = 4096
HOLD_LEAST = 0.75  # of the interval

Answer = tuple[int, bytes]  # status, JSON body
M = TypeVar("M", bound=BaseModel)


class AgentApi:
    """The agent API of one control plane, checked with its agent token (none: open)."""

    def __init__(self, cp: ControlPlane, spread: Callable[[], float] = random.random) -> None:
        self.cp = cp
        self.spread = spread  # a number in [0, 1): where in its range a heartbeat's hold ends
        self.paths: dict[str, Callable[[Scope, Receive], Awaitable[Answer]]] = {
            "/v1/report": self.report,
            "/v1/heartbeat": self.heartbeat,
        }

        async def wrong_method(request: Request) -> Response:  # reached by POST never
            raise AssertionError("POST is served by AgentApi itself")

        # Another method on a known path gets 405, an unknown path 404.
        self.rest = Starlette(routes=[Route(p, wrong_method, methods=["POST"]) for p in self.paths])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        serve = self.paths.get(scope.get("path", "")) if scope["type"] == "http" else None
        if serve is None or scope["method"] != "POST":
            await self.rest(scope, receive, send)
            return
        token = self.cp.config.agent_token
        if token is not None and not bearer_matches(header(scope, b"authorization"), token):
            await send_json(send, 401, error_json("missing or wrong agent token"))
            return
        status, body = await serve(scope, receive)
        await send_json(send, status, body)

    async def report(self, scope: Scope, receive: Receive) -> Answer:
        cp = self.cp
        sent = await _receive(scope, receive, AgentReport, "report", cp.config.max_report_bytes)
        if not isinstance(sent, AgentReport):
            return sent
        catalog = cp.catalogs.current
        try:
            changed = cp.state.take_report(sent, catalog, cp.clock.monotonic())
        except StaleReport as exc:
            return 409, error_json(str(exc))
        timing = cp.retime()
        if changed:
            cp.wake()
            cp.notify_assignments()
        assignment = cp.assignments.of(sent.node, catalog, timing.interval)
        return 200, assignment.model_dump_json().encode()

    async def heartbeat(self, scope: Scope, receive: Receive) -> Answer:
        cp = self.cp
        beat = await _receive(scope, receive, Heartbeat, "heartbeat", MAX_HEARTBEAT_BYTES)
        if not isinstance(beat, Heartbeat):
            return beat
        now = cp.clock.monotonic()
        try:
            fresh_again = cp.state.take_heartbeat(beat, now)
        except (ReportFirst, StaleReport) as exc:
            return 409, error_json(str(exc))
        if fresh_again:
            cp.wake()
        interval = cp.retime().interval
        until = now + interval * (HOLD_LEAST + (1 - HOLD_LEAST) * self.spread())
        while cp.assignments.version(beat.node, cp.catalogs.current) == beat.assignment:
            left = until - cp.clock.monotonic()
            if left <= 0 or not await cp.watch.wait(beat.node, left):
                if cp.watch.closed:  # tell the agent to wait, or it beats again at once
                    return 503, error_json("the control plane is stopping")
                return 200, HeartbeatAnswer(heartbeat_interval=interval).model_dump_json().encode()
        assignment = cp.assignments.of(beat.node, cp.catalogs.current, interval)
        answer = HeartbeatAnswer(heartbeat_interval=interval, assignment=assignment)
        return 200, answer.model_dump_json().encode()


async def _receive(
    scope: Scope, receive: Receive, message: type[M], what: str, limit: int
) -> M | Answer:
    """The request's body as a `message`, or the answer refusing it: too long, or malformed."""
    body = await receive_at_most(scope, receive, limit)
    if body is None:
        return 413, error_json(f"a {what} may have at most {limit} bytes")
    try:
        return message.model_validate_json(body)
    except ValidationError as exc:
        return 400, error_json(f"malformed {what}: {exc.error_count()} problem(s): {exc}")


def create_agent_app(cp: ControlPlane) -> AgentApi:
    """The agent API of `cp`."""
    return AgentApi(cp)
