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

`GET /v1/leader`: who leads, as this control plane knows (`LeaderAnswer`), answered by a
follower too: an agent given several control planes asks them all and goes straight to the
leader, past one that does not answer (`agent/uplink.py`).

`GET /v1/join/ca` (open) and `POST /v1/join` (a join token as bearer): a new node fetches the
fleet's CA, checks it against the fingerprint its join token pins, and exchanges the token for
a credential of its own (`membership.py`).

Who may send what: a node's credential is taken for that node only; a report or heartbeat
naming another is refused (403) and logged, and so is a report of a joined node advertising an
address other than the one it joined from (`membership.address_refusal`). The fleet's shared
agent token (`agent_token`, the mode `up` runs in) may report as any node that has not joined
with a credential of its own.

Report and heartbeat are served as bare ASGI, not through Starlette's routing and middleware:
every node of the fleet holds a heartbeat at all times, and what each one holds (coroutines,
request objects) is what the garbage collector scans and what a restart of 10,000 nodes pays for
(bench/controlplane_scale.py). Anything else goes to a Starlette app: 404, 405, lifespan.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from modelfleet.controlplane import nodes
from modelfleet.controlplane.doors import retry_after
from modelfleet.controlplane.membership import MembershipRefused
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.controlplane.records import ReportFirst, StaleReport
from modelfleet.core.fleet import Mark
from modelfleet.core.nesting import TooDeep, check_json
from modelfleet.core.throttle import Verdict
from modelfleet.http.web import (
    bearer,
    bearer_matches,
    error_json,
    header,
    receive_at_most,
    send_json,
)
from modelfleet.messages.wire import (
    AgentReport,
    Heartbeat,
    HeartbeatAnswer,
    JoinRequest,
    LeaderAnswer,
    LogAnswer,
    NodeUse,
)
from modelfleet.security.joining import CREDENTIAL_PREFIX
from modelfleet.store import StoreError

log = logging.getLogger("modelfleet.controlplane")

MAX_HEARTBEAT_BYTES = 4096
MAX_JOIN_BYTES = 16384
MAX_LOG_ANSWER_BYTES = 4 << 20
ANY_NODE = ""  # who holds the fleet's shared agent token: any node not joined on its own
HOLD_LEAST = 0.75  # of the interval
STANDING_IN = b"x-modelfleet-standing-in"  # on an answer of a leader whose store is down

Answer = tuple[int, bytes]  # status, JSON body
M = TypeVar("M", bound=BaseModel)


class AgentApi:
    """The agent API of one control plane."""

    def __init__(self, cp: ControlPlane, spread: Callable[[], float] = random.random) -> None:
        self.cp = cp
        self.spread = spread  # a number in [0, 1): where in its range a heartbeat's hold ends
        self.paths: dict[str, Callable[[Scope, Receive, str], Awaitable[Answer]]] = {
            "/v1/report": self.report,
            "/v1/heartbeat": self.heartbeat,
            "/v1/logs": self.log_answer,
        }

        # Joins need no credential: they are how a node gets one.
        self.joins: dict[tuple[str, str], Callable[[Scope, Receive, Send], Awaitable[None]]] = {
            ("GET", "/v1/join/ca"): self.join_ca,
            ("POST", "/v1/join"): self.join,
        }

        async def wrong_method(request: Request) -> Response:  # reached by the others never
            raise AssertionError("served by AgentApi itself")

        # Another method on a known path gets 405, an unknown path 404.
        self.rest = Starlette(
            routes=[
                *(Route(p, wrong_method, methods=["POST"]) for p in self.paths),
                *(Route(p, wrong_method, methods=[m]) for m, p in self.joins),
                Route("/v1/leader", wrong_method, methods=["GET"]),
            ]
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        serve = self.paths.get(scope.get("path", "")) if scope["type"] == "http" else None
        if serve is None and scope.get("path") == "/v1/leader" and scope["method"] == "GET":
            await self.who_leads(scope, send)
            return
        if serve is None or scope["method"] != "POST":
            joining = self.joins.get((scope.get("method", ""), scope.get("path", "")))
            if joining == self.join and not self.cp.acting():
                await self._join_to_leader(scope, send)  # the leader keeps the credentials
                return
            await (joining or self.rest)(scope, receive, send)
            return
        holder = await self._admitted(scope, send)
        if holder is None:
            return
        if not self.cp.serving_fleet():
            await self._to_leader(scope, send)
            return
        status, body = await serve(scope, receive, holder)
        if not self.cp.serving_fleet():  # it stopped leading while the answer was made
            await self._to_leader(scope, send)
            return
        # Standing in for its store (it leads no lease now): the agent asks who leads before
        # its next exchange, and goes to a control plane that took the lease meanwhile.
        standing_in = [(STANDING_IN, b"1")] if not self.cp.acting() else None
        await send_json(send, status, body, standing_in)

    async def who_leads(self, scope: Scope, send: Send) -> None:
        """`GET /v1/leader`, to an agent this control plane admits: whether it leads and acts
        now, and the leader as its last lease renewal read it (no store call: it answers at
        once whatever the store does)."""
        if await self._admitted(scope, send) is None:
            return
        leadership = self.cp.leadership
        acting = self.cp.serving_fleet()
        own = leadership.urls[0] if leadership.urls is not None else None
        answer = LeaderAnswer(
            leading=acting,
            epoch=leadership.epoch,
            leader=leadership.leader,
            leader_url=own if acting else leadership.leader_url("agent"),
        )
        await send_json(send, 200, answer.model_dump_json().encode())

    async def _admitted(self, scope: Scope, send: Send) -> str | None:
        """Who the request speaks for (`_holder`), checked before anything else is done with
        it, on a follower too: one that carries no token or credential taken here is
        refused (401), and an address that fails again and again waits (429, `doors.py`).
        None when it was refused, having answered."""
        cp = self.cp
        source = _source(scope)
        taken = cp.doors.attempt("agent", source)
        if taken.wait > 0:
            await self._throttled(send, taken, f"too many wrong agent tokens from {source}")
            return None
        holder = self._holder(scope)
        if holder is None and not cp.acting() and self._credential(scope):
            # A follower reads the credentials from the store when it is asked by one it
            # does not know: a node may have joined since it last read them. What a guesser
            # costs it is one read per try its address is let make.
            with contextlib.suppress(StoreError):
                await cp.read_desired()
            holder = self._holder(scope)
        if holder is None:
            why = self._why_refused(scope)
            cp.doors.failed("agent", source, why, taken)
            cp.metrics.refused.labels("credential").inc()
            await send_json(send, 401, error_json(why))
            return None
        cp.doors.succeeded("agent", source)
        return holder

    async def _join_to_leader(self, scope: Scope, send: Send) -> None:
        """A join sent to a follower: its token checked first (as the leader would, from
        what the store holds: a token may have been made since this one last read), then
        sent to the leader (`_to_leader`)."""
        cp = self.cp
        source = _source(scope)
        taken = await self._join_attempt(source, send)
        if taken is None:
            return
        presented = bearer(header(scope, b"authorization")) or ""
        try:
            try:
                cp.membership.usable_token(presented, cp.store_time())
            except MembershipRefused as exc:
                if exc.status != 401:
                    raise
                with contextlib.suppress(StoreError):
                    await cp.read_desired()
                cp.membership.usable_token(presented, cp.store_time())
        except MembershipRefused as exc:
            if exc.status == 401:
                cp.doors.failed("join", source, str(exc), taken)
            else:
                cp.doors.uncount("join", source)
            await send_json(send, exc.status, error_json(str(exc)))
            return
        cp.doors.succeeded("join", source)
        await self._to_leader(scope, send)

    async def _join_attempt(self, source: str, send: Send) -> Verdict | None:
        """A join from `source` counted as its head arrives, before its body is read (see
        doors.py); None when it waits, its 429 sent."""
        taken = self.cp.doors.attempt("join", source)
        if taken.wait > 0:
            await self._throttled(send, taken, f"too many failed joins from {source}")
            return None
        return taken

    async def _throttled(self, send: Send, taken: Verdict, why: str) -> None:
        wait = retry_after(taken)
        message = f"{why}: try again in {wait}s"
        await send_json(send, 429, error_json(message), [(b"retry-after", wait.encode())])

    async def _to_leader(self, scope: Scope, send: Send) -> None:
        """A follower's answer: 307 to the same path on the leader, which the agent sends its
        request to at once; 503 while the leader is not known or has not said where it is.
        Either way the agent keeps its engines."""
        leadership = self.cp.leadership
        leader = leadership.leader or "none yet"
        url = leadership.leader_url("agent")
        lapsed = leadership.lapsed()
        if lapsed is not None:
            await send_json(send, 503, error_json(f"{lapsed}; try again shortly"))
            return
        if url is None:
            message = f"this control plane follows; the leader is {leader}, not reachable yet"
            await send_json(send, 503, error_json(message))
            return
        location = url.rstrip("/") + scope.get("path", "")
        message = f"this control plane follows; the leader is {leader} at {url}"
        await send_json(send, 307, error_json(message), [(b"location", location.encode())])

    @staticmethod
    def _credential(scope: Scope) -> bool:
        """Whether the request carries what reads as a node's credential."""
        presented = bearer(header(scope, b"authorization"))
        return presented is not None and presented.startswith(CREDENTIAL_PREFIX)

    def _holder(self, scope: Scope) -> str | None:
        """The node whose credential the request carries; ANY_NODE for the fleet's shared
        agent token (or an API left open); None when it carries neither."""
        presented = bearer(header(scope, b"authorization"))
        if presented is not None and presented.startswith(CREDENTIAL_PREFIX):
            return self.cp.membership.node_of(presented)
        config = self.cp.config
        if config.agent_token is not None:
            matches = bearer_matches(header(scope, b"authorization"), config.agent_token)
            return ANY_NODE if matches else None
        return ANY_NODE if config.insecure_agent_api else None

    def _why_refused(self, scope: Scope) -> str:
        """Why a request carries no token or credential taken here, for its agent to say."""
        presented = bearer(header(scope, b"authorization"))
        if presented is None or not presented.startswith(CREDENTIAL_PREFIX):
            return "missing or wrong agent token"
        node = self.cp.membership.revoked_node(presented)
        if node is not None:
            return (
                f"node {node} was revoked: its credential is taken no more; it comes back only "
                "by joining anew, with a new join token"
            )
        return (
            "this node credential is not valid here (its node was revoked, or it is of another "
            "fleet): join anew with a new join token"
        )

    def _refuse_as(self, holder: str, node: str, scope: Scope) -> Answer | None:
        """Why a request carrying `holder`'s credential may not speak for `node`, if so."""
        cp = self.cp
        if holder == ANY_NODE and cp.membership.has_joined(node):
            why = f"node {node} has joined with a credential of its own: only it speaks for it"
        elif holder not in (ANY_NODE, node):
            why = f"this credential is node {holder}'s: it may not speak for node {node}"
        else:
            record = cp.state.nodes.get(node)
            if record is None or record.mark.mark is not Mark.REVOKED:
                return None
            why = f"node {node} was revoked: it comes back only by joining anew"
        client = scope.get("client") or ("?", 0)
        log.warning("refused a request from %s naming node %s: %s", client[0], node, why)
        cp.metrics.refused.labels("impersonation").inc()
        return 403, error_json(why)

    def _refuse_address(self, holder: str, sent: AgentReport, scope: Scope) -> Answer | None:
        """Why a joined node may not advertise the address its report gives, if so
        (`membership.address_refusal`). A node on the shared agent token is not checked: it
        is trusted as the fleet's own (`up`, all on one machine)."""
        if holder == ANY_NODE:
            return None
        why = self.cp.membership.address_refusal(sent.node, sent.address)
        if why is None:
            return None
        client = scope.get("client") or ("?", 0)
        log.warning("refused a report from %s: %s", client[0], why)
        self.cp.metrics.refused.labels("address").inc()
        return 403, error_json(why)

    async def join_ca(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The fleet's CA certificate, for a joining node to check against its token."""
        ca = self.cp.membership.ca
        if ca is None:
            await send_json(send, 503, error_json("this control plane has no CA"))
            return
        body = ca.cert_pem
        headers = [
            (b"content-type", b"application/x-pem-file"),
            (b"content-length", b"%d" % len(body)),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def join(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Exchange the join token the request carries for a credential of the node it names."""
        cp = self.cp
        source = _source(scope)
        taken = await self._join_attempt(source, send)
        if taken is None:
            return
        request = await _receive(scope, receive, JoinRequest, "join", MAX_JOIN_BYTES)
        if not isinstance(request, JoinRequest):
            cp.doors.uncount("join", source)
            await send_json(send, *request)
            return
        presented = bearer(header(scope, b"authorization")) or ""
        try:
            answer = await nodes.join(cp, presented, request, source)
        except MembershipRefused as exc:
            if exc.status == 401:  # a token that is not one: what a guesser gets
                cp.doors.failed("join", source, f"node {request.node}: {exc}", taken)
            else:
                cp.doors.uncount("join", source)
                log.warning("refused a join of node %s from %s: %s", request.node, source, exc)
            await send_json(send, exc.status, error_json(str(exc)))
            return
        except StoreError as exc:
            cp.doors.uncount("join", source)
            await send_json(send, 503, error_json(str(exc)))
            return
        cp.doors.succeeded("join", source)
        await send_json(send, 200, answer.model_dump_json().encode())

    async def report(self, scope: Scope, receive: Receive, holder: str) -> Answer:
        cp = self.cp
        sent = await _receive(scope, receive, AgentReport, "report", cp.config.max_report_bytes)
        if not isinstance(sent, AgentReport):
            return sent
        refused = self._refuse_as(holder, sent.node, scope) or self._refuse_address(
            holder, sent, scope
        )
        if refused is not None:
            return refused
        catalog = cp.catalogs.current
        try:
            changed = cp.state.take_report(sent, catalog, cp.clock.monotonic())
        except StaleReport as exc:
            return 409, error_json(str(exc))
        cp.metrics.reports.inc()
        cp.recorder.gpus(sent.node, NodeUse.of(sent.gpus))
        timing = cp.retime()
        if changed:
            cp.wake()
            cp.notify_assignments()
        assignment = cp.assignments.of(sent.node, catalog, timing.interval)
        logs = cp.logs.take(sent.node)
        update = {"epoch": cp.leadership.leading_epoch or 0, "log_requests": logs}
        return 200, assignment.model_copy(update=update).model_dump_json().encode()

    async def heartbeat(self, scope: Scope, receive: Receive, holder: str) -> Answer:
        cp = self.cp
        beat = await _receive(scope, receive, Heartbeat, "heartbeat", MAX_HEARTBEAT_BYTES)
        if not isinstance(beat, Heartbeat):
            return beat
        refused = self._refuse_as(holder, beat.node, scope)
        if refused is not None:
            return refused
        now = cp.clock.monotonic()
        try:
            fresh_again = cp.state.take_heartbeat(beat, now)
        except (ReportFirst, StaleReport) as exc:
            return 409, error_json(str(exc))
        cp.metrics.heartbeats.inc()
        if beat.use is not None:
            cp.recorder.gpus(beat.node, beat.use)
        if fresh_again:
            cp.wake()
        interval = cp.retime().interval
        epoch = cp.leadership.leading_epoch or 0
        until = now + interval * (HOLD_LEAST + (1 - HOLD_LEAST) * self.spread())
        node = beat.node
        while cp.assignments.version(
            node, cp.catalogs.current
        ) == beat.assignment and not cp.logs.pending(node):
            left = until - cp.clock.monotonic()
            if left <= 0 or not await cp.watch.wait(node, left):
                if cp.watch.closed:  # tell the agent to wait, or it beats again at once
                    return 503, error_json("the control plane is stopping")
                answer = HeartbeatAnswer(heartbeat_interval=interval, epoch=epoch)
                return 200, answer.model_dump_json().encode()
        logs = cp.logs.take(node)
        assignment = None
        if cp.assignments.version(node, cp.catalogs.current) != beat.assignment:
            made = cp.assignments.of(node, cp.catalogs.current, interval)
            assignment = made.model_copy(update={"epoch": epoch})
        answer = HeartbeatAnswer(
            heartbeat_interval=interval, assignment=assignment, log_requests=logs, epoch=epoch
        )
        return 200, answer.model_dump_json().encode()

    async def log_answer(self, scope: Scope, receive: Receive, holder: str) -> Answer:
        """An agent sends what it read of a log the control plane asked for."""
        answer = await _receive(scope, receive, LogAnswer, "log answer", MAX_LOG_ANSWER_BYTES)
        if not isinstance(answer, LogAnswer):
            return answer
        # Only the node it was asked of may answer: a credential names its node; the shared
        # token (any node) answers only what some node was asked.
        taken = any(
            self.cp.logs.answered(node, answer)
            for node in ([holder] if holder != ANY_NODE else list(self.cp.state.nodes))
        )
        if not taken:
            return 404, error_json(f"no log request {answer.id} waits for this node")
        return 200, b"{}"


def _source(scope: Scope) -> str:
    """The address a request came from."""
    return str((scope.get("client") or ("?", 0))[0])


async def _receive(
    scope: Scope, receive: Receive, message: type[M], what: str, limit: int
) -> M | Answer:
    """The request's body as a `message`, or the answer refusing it: too long, or malformed."""
    body = await receive_at_most(scope, receive, limit)
    if body is None:
        return 413, error_json(f"a {what} may have at most {limit} bytes")
    try:
        check_json(body)
    except TooDeep as exc:
        return 400, error_json(f"malformed {what}: {exc}")
    try:
        return message.model_validate_json(body)
    except ValidationError as exc:
        return 400, error_json(f"malformed {what}: {exc.error_count()} problem(s): {exc}")


def create_agent_app(cp: ControlPlane) -> AgentApi:
    """The agent API of `cp`."""
    return AgentApi(cp)
