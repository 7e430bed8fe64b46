"""The router's fast lane: most requests carried through by callbacks, without a task.

Side by side with vllm-router at 50 requests/s (`bench/router.py`), what was left of the
router's added latency was Python's machinery more than the router's own work: a task per
request, futures to wake it, timeout scopes, ASGI messages. A request on the lean server
(`http1.py`) whose small body is in whole comes here first, still inside the parser's
callback, and is read and planned by the proxy's own code (`Proxy.plan`). Then:

- a refusal (bad key, unknown model, 413, a key over its limit) is answered at once;
- a non-streamed request that can be admitted at once (no limits, or a limit held in memory
  or in a lease) goes out on an idle kept-alive connection at once. The engine's connection
  tells the lane when the answer is in (`Connection.listener`); a whole answer goes to the
  client from that callback, in one write;
- everything else is handed to a task that goes on where the lane stopped (`Cycle.carry_on`):
  a stream, a request that must wait for its limits or a new connection, an answer that did
  not come whole at once, and a failed attempt, which is retried on another replica just as
  the proxy retries.

The lane answers what the proxy would, with the same headers, metrics and usage: the proxy's
coroutine is the reference, and the lane's tests send every request both ways.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from modelfleet.router.limits import Refusal as LimitRefusal
from modelfleet.router.limits import Ticket
from modelfleet.router.proxy import PROXY_PATHS, RETRY_STATUSES, Plan, Proxy, Refusal
from modelfleet.router.upstream import UpstreamError

if TYPE_CHECKING:
    from modelfleet.http1 import Cycle
    from modelfleet.router.proxy import Exchange
    from modelfleet.router.upstream import Connection


class FastLane:
    """Takes requests from the lean server before any task is made for them (`take`)."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.router = proxy.router

    def take(self, cycle: Cycle) -> bool:
        """Answer or carry on a POST whose whole body is in; False: not a proxied path."""
        scope = cycle.scope
        path = scope["path"]
        if path not in PROXY_PATHS:
            return False
        proxy, router = self.proxy, self.router
        ex, authorization, _ = proxy.exchange(scope)
        raw = cycle.take_body()
        key = proxy.check_key(authorization)
        if isinstance(key, Refusal):
            got: Plan | Refusal = key
        elif len(raw) > router.config.max_body_bytes:
            got = proxy.too_large()
        else:
            got = proxy.plan(ex, key, path, raw)
        if isinstance(got, Refusal):
            self._refuse(cycle, ex, got)
            return True
        plan = got
        admitted: Ticket | LimitRefusal | None = None
        if plan.limited:
            admitted = router.limits.admit_at_once(
                plan.key, plan.cost, ex.request_id, router.wall()
            )
            if isinstance(admitted, LimitRefusal):
                self._refuse(cycle, ex, proxy.over_limit(plan, admitted))
                return True
        if not plan.stream and (admitted is not None or not plan.limited):
            endpoint = router.balancer.pick(plan.endpoints, exclude=(), prefix=plan.prefix)
            conn = None
            if endpoint is not None:
                with contextlib.suppress(UpstreamError):  # the task says why, as the proxy does
                    conn = router.upstreams.idle(endpoint)
            if endpoint is not None and conn is not None:
                _Flight(self, cycle, ex, plan, admitted, endpoint, conn).send()
                return True
        self._carry_on(cycle, ex, plan, admitted, [])
        return True

    def _refuse(self, cycle: Cycle, ex: Exchange, refusal: Refusal) -> None:
        cycle.answer(*self.proxy.refusal_answer(ex, refusal))
        self.proxy.finish(ex)

    def _carry_on(
        self,
        cycle: Cycle,
        ex: Exchange,
        plan: Plan,
        admitted: Ticket | LimitRefusal | None,
        tried: list[str],
    ) -> None:
        """Hand the request to a task that serves it as the proxy does, from admission on
        (with `admitted` if it was admitted already), trying no replica in `tried` again."""
        proxy = self.proxy
        scope = cycle.scope

        def work(receive: Any, send: Any) -> Any:
            return proxy.run(ex, proxy.serve(ex, scope, receive, send, plan, admitted, tried))

        cycle.carry_on(work)


class _Flight:
    """A request the lane sent to an engine, its answer awaited by callbacks."""

    __slots__ = ("conn", "cycle", "endpoint", "ex", "lane", "plan", "sent_at", "ticket", "timer")

    def __init__(
        self,
        lane: FastLane,
        cycle: Cycle,
        ex: Exchange,
        plan: Plan,
        ticket: Ticket | LimitRefusal | None,
        endpoint: str,
        conn: Connection,
    ) -> None:
        self.lane = lane
        self.cycle = cycle
        self.ex = ex
        self.plan = plan
        self.ticket = ticket if isinstance(ticket, Ticket) else None
        self.endpoint = endpoint
        self.conn = conn
        self.sent_at = 0.0
        self.timer: asyncio.TimerHandle | None = None

    def send(self) -> None:
        lane, plan, endpoint, conn = self.lane, self.plan, self.endpoint, self.conn
        router = lane.router
        router.balancer.begin(endpoint)
        self.sent_at = lane.proxy.clock()
        self.ex.maybe_used += 1
        router.upstreams.send(
            endpoint, conn, plan.path, plan.raw, lane.proxy.engine_headers(self.ex, endpoint)
        )
        conn.listener = self.on_answer
        loop = conn.loop
        self.timer = loop.call_at(loop.time() + self.first_byte_timeout, self.on_timeout)
        self.cycle.call_on_disconnect(self.on_gone)

    @property
    def first_byte_timeout(self) -> float:
        return self.plan.route.first_byte_timeout or self.lane.router.config.first_byte_timeout

    def _stop_waiting(self) -> None:
        self.conn.listener = None
        self.cycle.call_on_disconnect(None)
        if self.timer is not None:
            self.timer.cancel()
        self.ex.upstream_wait += self.lane.proxy.clock() - self.sent_at

    def on_answer(self, conn: Connection) -> None:
        """The connection has news: the answer's first bytes or all of it, or a failure."""
        self._stop_waiting()
        if conn.error is not None:
            if not conn.got_bytes:
                # A kept-alive connection the engine closed as the request went out: the
                # engine never began it, and the proxy sends it again on a new connection.
                self.ex.maybe_used -= 1
                conn.close()
                self._retry(failure=None)
                return
            self._failed(f"{type(conn.error).__name__}: {conn.error}"[:200])
            return
        if conn.status >= 400:
            self.ex.maybe_used -= 1  # the engine refused it
        if conn.status in RETRY_STATUSES:
            self._failed(f"HTTP {conn.status}")
            return
        lane, ex, endpoint = self.lane, self.ex, self.endpoint
        proxy, router = lane.proxy, lane.router
        upstream = router.upstreams.answer(endpoint, conn)
        first = conn.take_chunks()
        if not upstream.at_eof:
            cycle, plan, ticket = self.cycle, self.plan, self.ticket
            scope = cycle.scope

            def work(receive: Any, send: Any) -> Any:
                relay = proxy.carry_answer(
                    ex, scope, receive, send, plan, ticket, upstream, endpoint, first
                )
                return proxy.run(ex, relay)

            cycle.carry_on(work)
            return
        ex.first_byte_at = proxy.clock()
        ex.status = upstream.status
        scanner = ex.scanner
        if scanner is not None:
            scanner.feed(first)
        self.cycle.answer(upstream.status, proxy.answer_head(ex, upstream, endpoint, False), first)
        if upstream.status < 500:
            router.balancer.succeeded(endpoint)
        proxy.end_attempt(endpoint, upstream, done=True)
        self._finish()

    def on_timeout(self) -> None:
        self.timer = None
        self._stop_waiting()
        self.ex.timeouts += 1
        self._failed(f"no first byte within {self.first_byte_timeout:g} s")

    def _failed(self, failure: str) -> None:
        self.lane.proxy.failed(self.ex, self.endpoint, failure)
        self._retry(failure)

    def _retry(self, failure: str | None) -> None:
        """No answer to relay: the connection is closed and the request goes on in a task,
        to another replica when this one failed (`failure`), to any when it did not."""
        self.lane.proxy.end_attempt(self.endpoint, None, done=False)
        self.conn.close()
        tried = [self.endpoint] if failure is not None else []
        self.lane._carry_on(self.cycle, self.ex, self.plan, self.ticket, tried)

    def on_gone(self) -> None:
        """The client went away: the engine's connection is closed, which aborts the
        request there."""
        self._stop_waiting()
        self.ex.client_gone = True
        self.lane.proxy.end_attempt(self.endpoint, None, done=False)
        self.conn.close()
        self._finish()

    def _finish(self) -> None:
        ex = self.ex
        ex.finished = True
        if self.ticket is not None:
            self.lane.proxy.settle(ex, self.ticket)
        self.lane.proxy.finish(ex)
