"""One request through the router, from its plan to its end: a `Flight`.

The flight moves a request through its stages, each a module of its own that a test can
drive alone: admission under its key's limits (`admit.py`), the replica tried next and why
none answered (`pick.py`), the answer relayed (`relay.py`), and the key's reservation
settled and the request counted (`settle.py`). What the stages share is `exchange.py`. The
flight itself holds the order of the stages: the retries, the first-byte timeout
(`Attempt`), a client that goes away, and ending exactly once.

A flight is a state machine that moves by callbacks wherever it can and by a task only
where it must wait. Side by side with vllm-router (`bench/router.py`) a task per request,
the futures that wake it and its timeout scopes were most of the router's own latency, so:

- admission from memory or a lease, the pick of a replica, sending on an idle kept-alive
  connection, the engine's answer (`Attempt`, told by the connection's callback), a retry
  on another replica and a whole answer's write to the client all run at once, from the
  callback that brought the news;
- admission that needs the store, a new connection, and the relay of an answer that did
  not come whole are waits: they run in the flight's task (`host`). A request read by the
  ASGI app already runs in one; a request the lean server handed over whole gets one the
  first time it must wait (`Client.host`), and most never do.

Either way the same methods run in the same order; only where a wait runs differs. The
client side is a seam (`Client`): the lean server's `Cycle`, or any ASGI server's `send`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from modelfleet.http.tracing import AttributeValue, SpanRecord, new_span_id
from modelfleet.router import settle
from modelfleet.router.admit import admission
from modelfleet.router.exchange import Broken, ClientGone
from modelfleet.router.pick import engine_headers, exhausted, pick
from modelfleet.router.refusal import Refusal
from modelfleet.router.relay import Relay, answer_head, scanned
from modelfleet.router.upstream import UpstreamError

if TYPE_CHECKING:
    from modelfleet.http.tracing import SpanSink
    from modelfleet.router.exchange import Client, Exchange, Parts, Plan
    from modelfleet.router.limits import Refusal as LimitRefusal
    from modelfleet.router.limits import Ticket
    from modelfleet.router.table import RoutingTable
    from modelfleet.router.upstream import Answer, Connection

log = logging.getLogger("modelfleet.router")

# Statuses an engine answers before it has produced anything, where another replica may do
# better: the request goes to another before the client has seen a byte.
RETRY_STATUSES = frozenset({502, 503, 504})


class Flight:
    """One request from its plan (or its refusal) to its end; see the module's docstring.

    `begin` starts it. It ends exactly once (`_end`): the key's reservation is settled and
    the request counted, whichever way it went."""

    __slots__ = (
        "_busy",
        "_hosted",
        "_task",
        "_waker",
        "_work",
        "attempt",
        "client",
        "ended",
        "ex",
        "parts",
        "plan",
        "rerouted",
        "ticket",
        "tried",
    )

    def __init__(self, parts: Parts, ex: Exchange, client: Client, in_task: bool) -> None:
        """`in_task`: the caller runs `host` in its own task (an ASGI app does)."""
        self.parts = parts
        self.ex = ex
        self.client = client
        self.plan: Plan | None = None
        self.ticket: Ticket | None = None
        self.tried: list[str] = []  # endpoints tried, in order
        self.rerouted = False  # sent on once after an engine said it lacks the adapter
        self.attempt: Attempt | None = None  # the one under way
        self.ended = False
        self._hosted = in_task  # a task runs, or will run, `host`
        self._work: Coroutine[Any, Any, None] | None = None  # the next wait for the task
        self._task: asyncio.Task[Any] | None = None
        self._busy = False  # the task is in a wait
        self._waker: asyncio.Future[None] | None = None

    # -- the steps, in the order a request takes them ----------------------------------------

    def begin(self, got: Plan | Refusal) -> None:
        """Refuse the request, or admit it under its key's limits and send it on."""
        if isinstance(got, Refusal):
            self.refuse(got)
            return
        self.plan = plan = got
        self.client.on_disconnect(self.gone)
        if self.ended:  # the client had gone already
            return
        if not plan.limited:
            self._next()
            return
        parts = self.parts
        admitted = parts.limits.admit_at_once(plan.key, plan.cost, self.ex.request_id, parts.wall())
        if admitted is None:
            self._carry(self._admit(plan))
        else:
            self._admitted(admitted)

    async def _admit(self, plan: Plan) -> None:
        parts = self.parts
        got = await parts.limits.admit(plan.key, plan.cost, self.ex.request_id, parts.wall())
        self._admitted(got)

    def _admitted(self, got: Ticket | LimitRefusal) -> None:
        plan = self.plan
        assert plan is not None
        admitted = admission(got, plan.key.name, plan.cost)
        if isinstance(admitted, Refusal):
            self.refuse(admitted)
            return
        self.ticket = admitted
        self._next()

    def _next(self) -> None:
        """Send the request to the next replica to try, or answer that none could take it."""
        parts, plan, tried = self.parts, self.plan, self.tried
        assert plan is not None
        if (
            not tried
            and plan.first is None
            and (not plan.endpoints or parts.cold.waiting)
            and parts.cold.take(self, plan.route, plan.endpoints)
        ):
            return
        # An engine's 404 for an adapter it let go is no failure: that resend is not a retry.
        while len(tried) <= parts.settings.retries + self.rerouted:
            endpoint = pick(plan, tried, parts.balancer)
            if endpoint is None:
                break
            if tried:
                parts.metrics.child(parts.metrics.retries, self.ex.model).inc()
            tried.append(endpoint)
            attempt = Attempt(self, endpoint)
            try:
                conn = parts.upstreams.idle(endpoint)
            except UpstreamError as exc:
                self._failed(attempt, _why(exc))
                continue
            if conn is None:
                self._carry(self._connect(attempt))
            else:
                attempt.send(conn, reused=True)
            return
        self.refuse(exhausted(self.ex, self.tried, self.first_byte_timeout))

    def released(self, table: RoutingTable, endpoint: str | None) -> None:
        """A held request goes on, to `endpoint` of `table` (None: the balancer's pick)."""
        plan = self.plan
        assert plan is not None
        plan.table = table
        plan.endpoints = table.models.get(plan.route.name, ())
        plan.route = table.routes.get(plan.route.name, plan.route)
        plan.first = endpoint
        try:
            self._next()
        except Exception:
            self.failed_in_callback()

    async def _connect(self, attempt: Attempt) -> None:
        """Send on a new connection: none was idle, or the idle one closed under the send."""
        parts = self.parts
        began = parts.clock()
        try:
            conn = await parts.upstreams.connect(attempt.endpoint)
        except UpstreamError as exc:
            self.ex.upstream_wait += parts.clock() - began
            self._failed(attempt, _why(exc))
            self._next()
            return
        self.ex.upstream_wait += parts.clock() - began
        attempt.send(conn, reused=False)

    def heard(self, attempt: Attempt, conn: Connection) -> None:
        """`attempt`'s connection has news: the answer's first bytes or all of it, or a
        failure. Called by the connection, once per attempt."""
        ex = self.ex
        if conn.error is not None:
            if attempt.reused and not conn.got_bytes:
                # A kept-alive connection the engine closed as the request went out: the
                # engine never began it, and a new connection carries it, as no failure.
                ex.maybe_used -= 1
                conn.close()
                self._carry(self._connect(attempt))
                return
            self._failed(attempt, _why(conn.error))
            self._next()
            return
        if conn.status >= 400:
            ex.maybe_used -= 1  # the engine refused it
        attempt.status = conn.status
        if conn.status == 404 and self._adapter_gone(attempt):
            return
        if conn.status in RETRY_STATUSES:
            self._failed(attempt, f"HTTP {conn.status}")
            self._next()
            return
        upstream = self.parts.upstreams.answer(attempt.endpoint, conn)
        self._answered(attempt, upstream, conn.take_chunks())

    def _adapter_gone(self, attempt: Attempt) -> bool:
        """An engine answered 404 to a request for a LoRA adapter: it let the adapter go after
        this router's table was taken (a swap, in the moment before the table said so). Once
        per request, it goes to another replica holding it in the current table, or is held
        until one does, instead of the client getting the 404."""
        plan, parts = self.plan, self.parts
        if plan is None or self.rerouted or plan.route.name not in plan.table.parents:
            return False
        self.rerouted = True
        attempt.failure = "the engine does not hold the adapter"
        attempt.over()
        self.ex.failures.append(f"{attempt.endpoint}: {attempt.failure}")
        table = parts.cold.table()
        others = [e for e in table.models.get(plan.route.name, ()) if e not in self.tried]
        if others or plan.route.name not in table.routes:
            self.released(table, None)
        else:
            plan.table, plan.endpoints = table, ()
            plan.route = table.routes[plan.route.name]
            if not parts.cold.take(self, plan.route, ()):
                self.refuse(exhausted(self.ex, self.tried, self.first_byte_timeout))
        return True

    def timed_out(self, attempt: Attempt) -> None:
        """`attempt` got no first byte within the first-byte timeout."""
        self.ex.timeouts += 1
        self._failed(attempt, f"no first byte within {self.first_byte_timeout:g} s")
        self._next()

    def given_up(self, attempt: Attempt, why: str) -> None:
        """`attempt`'s engine turned out unreachable before its first byte: the request goes
        to the next replica as after a timeout, without waiting for one."""
        self._failed(attempt, why)
        self._next()

    def _failed(self, attempt: Attempt, failure: str) -> None:
        """`attempt` gave no answer to relay: noted, and its replica ejected if it keeps
        failing."""
        attempt.failure = failure
        attempt.over()
        parts, endpoint = self.parts, attempt.endpoint
        self.ex.failures.append(f"{endpoint}: {failure}")
        if parts.balancer.failed(endpoint, parts.now(), failure):
            parts.metrics.ejections.labels(endpoint).inc()
            log.warning("endpoint %s ejected after failing again and again", endpoint)

    def _answered(self, attempt: Attempt, upstream: Answer, first: bytes) -> None:
        """The engine answered: a whole answer goes to the client at once; of one still
        coming (a stream), the head and first bytes go at once where the client allows it,
        and the rest is relayed by the task as it arrives."""
        parts, ex = self.parts, self.ex
        ex.first_byte_at = parts.clock()
        ex.status = upstream.status
        plan = self.plan
        assert plan is not None
        headers = answer_head(upstream, plan, attempt.endpoint, ex.request_id, ex.scanner)
        if upstream.at_eof:
            body = scanned(ex.scanner, first, last=True)
            if upstream.status < 500:
                parts.balancer.succeeded(attempt.endpoint)
            attempt.over(upstream, done=True)
            self._respond(upstream.status, headers, body)
            return
        out = scanned(ex.scanner, first, last=False)
        if self.client.answer(upstream.status, headers, out, more=True):
            self._carry(self._relay(attempt, upstream, None, b""))
        else:
            self._carry(self._relay(attempt, upstream, headers, out))

    async def _relay(
        self,
        attempt: Attempt,
        upstream: Answer,
        headers: list[tuple[bytes, bytes]] | None,
        first: bytes,
    ) -> None:
        """Relay the rest of an answer (`Relay`), and end."""
        parts, ex, plan = self.parts, self.ex, self.plan
        assert plan is not None
        relay = Relay(
            self.client.send, parts.clock, parts.settings.chunk_timeout, ex.scanner,
            plan.stream, ex.model, attempt.endpoint,
        )  # fmt: skip
        done = False
        try:
            done = await relay.run(upstream, headers, first)
            if upstream.status < 500:
                parts.balancer.succeeded(attempt.endpoint)
        finally:
            ex.upstream_wait += relay.waited
            attempt.over(upstream, done)
        self._end()

    def refuse(self, refusal: Refusal) -> None:
        """Answer with the router's own OpenAI-style error, counted by its reason."""
        ex = self.ex
        headers, body = refusal.answer(ex.request_id)
        ex.status = refusal.status
        if not self.tried:
            ex.refusal = refusal.reason
        self._respond(refusal.status, headers, body)

    def _respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """Send a whole answer, and end."""
        if self.client.answer(status, headers, body, more=False):
            self._end()
        else:
            self._carry(self._send_whole(status, headers, body))

    async def _send_whole(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> None:
        send = self.client.send
        try:
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
        except OSError as exc:
            raise ClientGone() from exc
        self._end()

    def gone(self) -> None:
        """The client went away: the request is abandoned where it is. An engine's
        connection is closed, which is how vLLM and SGLang learn to abort."""
        try:
            if self.ended:
                return
            self.ex.client_gone = True
            self._drop_attempt()
            task = self._task
            if self._busy and task is not None:
                task.cancel()  # `host` ends the flight once the wait has unwound
                return
            self._end()
        except Exception:
            log.exception("abandoning request %s failed", self.ex.request_id)

    def failed_in_callback(self) -> None:
        """A step run by a callback raised (a bug): answered with a 500 if nothing was
        answered yet, and ended either way, so that nothing stays held."""
        log.exception("the router failed on request %s", self.ex.request_id)
        self._drop_attempt()
        if self.ended:
            return
        try:
            self.refuse(
                Refusal(500, "The router failed on this request.", "server_error", "router-error")
            )
        except Exception:
            log.exception("answering request %s with a 500 failed", self.ex.request_id)
            self._end()

    def _drop_attempt(self) -> None:
        """The attempt under way, if any, is abandoned: its connection is closed, which aborts
        the request at the engine."""
        attempt = self.attempt
        if attempt is not None:
            attempt.stop_waiting()
            attempt.over()

    def _end(self, count: bool = True) -> None:
        """The request is over: its reservation settled, the request counted (`count`: it was
        not cut off by a shutdown). Runs once."""
        if self.ended:
            return
        self.ended = True
        work = self._work
        if work is not None:  # a wait never begun
            self._work = None
            work.close()
        cold = self.parts.cold
        if cold.waiting:
            cold.discard(self)
            if self.plan is not None:  # what it leaves may be taken by one held
                cold.release(self.plan.route.name)
        self.client.on_disconnect(None)
        if self.ticket is not None:
            settle.settle(self.parts, self.ex, self.ticket)
        if count:
            settle.count(self.parts, self.ex, len(self.tried))
        waker = self._waker
        if waker is not None and not waker.done():
            waker.set_result(None)

    # -- the task, for the waits -------------------------------------------------------------

    def _carry(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` in the flight's task: the one it has, or one started for it now."""
        assert self._work is None, "a flight waits for one thing at a time"
        self._work = work
        if not self._hosted:
            self._hosted = True
            self.client.host(self.host())
            return
        waker = self._waker
        if waker is not None and not waker.done():
            waker.set_result(None)

    async def host(self) -> None:
        """Run the flight's waits one after another until it ends."""
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        count = True
        try:
            while not self.ended:
                work = self._work
                if work is None:
                    self._waker = task.get_loop().create_future()
                    await self._waker
                    self._waker = None
                    continue
                self._work = None
                self._busy = True
                try:
                    await work
                finally:
                    self._busy = False
        except asyncio.CancelledError:
            if not self.ex.client_gone:
                count = False  # cancelled by a shutdown: settled, not counted
                raise
            task.uncancel()
        except ClientGone:
            self.ex.client_gone = True
        except Broken:
            pass  # the connection closes short of the promised length; the status counts
        finally:
            self._task = None
            self._drop_attempt()
            self._end(count)

    # -- what the steps share ----------------------------------------------------------------

    @property
    def first_byte_timeout(self) -> float:
        plan = self.plan
        assert plan is not None
        return plan.route.first_byte_timeout or self.parts.settings.first_byte_timeout


class Attempt:
    """One try of one replica: the request written on a connection, and the answer's first
    bytes awaited by the connection's callback within the first-byte timeout (counted from
    the write; a new connection has `connect_timeout` of its own)."""

    __slots__ = (
        "began",
        "conn",
        "endpoint",
        "failure",
        "flight",
        "is_over",
        "reused",
        "sent_at",
        "span_id",
        "status",
        "timer",
    )

    def __init__(self, flight: Flight, endpoint: str) -> None:
        self.flight = flight
        self.endpoint = endpoint
        self.span_id = new_span_id()  # the engine's span is its child
        self.began = flight.parts.clock()
        self.failure: str | None = None  # why it gave no answer to relay, for its span
        self.status = 0  # the engine's answer's status, once it has come
        self.conn: Connection | None = None
        self.reused = False
        self.sent_at = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.is_over = False
        flight.attempt = self
        flight.parts.balancer.begin(endpoint)

    def send(self, conn: Connection, reused: bool) -> None:
        """Write the request on `conn` (`reused`: a kept-alive one) and wait for its news."""
        flight = self.flight
        parts, plan = flight.parts, flight.plan
        assert plan is not None
        self.conn = conn
        self.reused = reused
        flight.ex.maybe_used += 1
        headers = engine_headers(plan, flight.ex, self.endpoint, self.span_id)
        parts.upstreams.send(self.endpoint, conn, plan.path, plan.raw, headers)
        self.sent_at = parts.clock()
        conn.listener = self._news
        loop = conn.loop
        self.timer = loop.call_at(loop.time() + flight.first_byte_timeout, self._timeout)
        parts.waiting.add(self)

    def stop_waiting(self) -> None:
        """No more news of the connection is awaited; the wait is counted as the engine's."""
        conn = self.conn
        if conn is None or conn.listener is None:
            return
        conn.listener = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        flight = self.flight
        flight.parts.waiting.discard(self)
        flight.ex.upstream_wait += flight.parts.clock() - self.sent_at

    def give_up(self, why: str) -> None:
        """Stop waiting for the engine, which does not answer at all (`Waiting.give_up`)."""
        self.stop_waiting()
        try:
            self.flight.given_up(self, why)
        except Exception:
            self.flight.failed_in_callback()

    def _news(self, conn: Connection) -> None:
        self.stop_waiting()
        try:
            self.flight.heard(self, conn)
        except Exception:
            self.flight.failed_in_callback()

    def _timeout(self) -> None:
        self.timer = None
        self.stop_waiting()
        try:
            self.flight.timed_out(self)
        except Exception:
            self.flight.failed_in_callback()

    def over(self, upstream: Answer | None = None, done: bool = False) -> None:
        """The attempt is over: its replica's count drops, and the connection goes back to
        the pool if the answer was read whole (`done`), else it is closed, which aborts the
        request at the engine. Runs once."""
        if self.is_over:
            return
        self.is_over = True
        flight = self.flight
        if flight.attempt is self:
            flight.attempt = None
        parts = flight.parts
        parts.balancer.end(self.endpoint)
        if parts.spans is not None and flight.ex.sampled:
            self._record(parts.spans, upstream)
        if upstream is not None:
            if done:
                upstream.release()
            else:
                upstream.close()
        elif self.conn is not None:
            self.conn.close()

    def _record(self, spans: SpanSink, upstream: Answer | None) -> None:
        flight = self.flight
        parts, ex, plan = flight.parts, flight.ex, flight.plan
        assert plan is not None
        attributes: dict[str, AttributeValue] = {
            "modelfleet.replica": plan.table.replicas.get(self.endpoint, self.endpoint),
            "server.address": self.endpoint,
            "modelfleet.attempt": len(flight.tried),
            "gen_ai.request.model": ex.model,
        }
        if self.status:
            attributes["http.response.status_code"] = self.status
        error = self.failure
        if error is None and upstream is None:
            error = "the client went away" if ex.client_gone else "cut off"
        spans.record(
            SpanRecord(
                name=f"attempt {plan.path}",
                trace_id=ex.trace_id,
                span_id=self.span_id,
                parent_id=ex.span_id,
                start_ns=parts.epoch_ns(self.began),
                end_ns=parts.epoch_ns(parts.clock()),
                kind="client",
                attributes=attributes,
                error=error,
            )
        )


def _why(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"[:200]
