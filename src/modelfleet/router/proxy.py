"""The router's data path: one client request in, one engine's answer out, as it arrives.

A raw ASGI handler, because the hot path needs what a framework's request object hides: the
body read once and only up to its limit, and the client's disconnect as an event. In order:

1. The key, the body (413 past `max_body_bytes`, unread), the JSON parsed once for `model`,
   `stream`, `max_tokens` and, for prefix routing, the prompt.
2. An endpoint from the balancer. Until the engine's first byte arrives nothing has been sent
   to the client, so a refused connection, a 502/503/504 or a first-byte timeout is tried
   again on another replica (`retries` times).
3. From the first byte on, the answer is relayed chunk by chunk, streamed or not. A gap
   between chunks longer than `chunk_timeout` ends a stream with an OpenAI-style error event;
   a whole answer cut short is cut for the client too (its Content-Length says so).
4. A client that goes away, before or after the first byte, cancels the request upstream:
   the connection to the engine is closed, which is how vLLM and SGLang learn to abort.

On the lean server most requests never reach `__call__`: the fast lane (`fast_lane.py`) runs
the same steps (`plan`, `refusal_answer`, `answer_head`, `failed`, `finish`) from callbacks,
and hands to `serve` or `carry_answer` whatever it cannot finish without waiting.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modelfleet.openai_api import (
    BadRequest,
    check_generation,
    error_body,
    parse_body,
    prompt_text,
)
from modelfleet.router.limits import Refusal as LimitRefusal
from modelfleet.router.limits import Ticket
from modelfleet.router.upstream import Answer, UpstreamError
from modelfleet.router.usage import UsageScanner

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

    from modelfleet.router.service import Router
    from modelfleet.router.table import ApiKey
    from modelfleet.wire import RoutedModel

log = logging.getLogger("modelfleet.router")

# The lean server's extension by which the proxy learns of a client's disconnect (http1.py).
ON_DISCONNECT = "modelfleet.on_disconnect"

PROXY_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})

# Statuses an engine answers before it has produced anything, where another replica may do
# better: the request goes to another before the client has seen a byte.
RETRY_STATUSES = frozenset({502, 503, 504})
# Statuses whose answer names why, in `x-modelfleet-reason`.
_WHY_STATUSES = frozenset({429, 503, 504})


class _ClientGone(Exception):
    """The client went away; what was in flight for it is dropped."""


@dataclass
class Exchange:
    """One request's way through the router."""

    request_id: str
    started: float
    model: str = "-"
    upstream_wait: float = 0.0  # seconds spent waiting for engines
    finished: bool = False
    client_gone: bool = False
    status: int = 0
    first_byte_at: float | None = None
    failures: list[str] = field(default_factory=list)
    timeouts: int = 0  # attempts that got no first byte in time
    scanner: UsageScanner | None = None  # finds the tokens the answer used
    key: str | None = None  # the name of the client's key, once it is known
    # Attempts written to an engine that it did not refuse (an error status): for these an
    # engine may have generated tokens, reported or not.
    maybe_used: int = 0


@dataclass(frozen=True)
class Refusal:
    """The router's own answer to a request it does not send on: an OpenAI-style error, and
    why (the `rejections` metric, `x-modelfleet-reason`)."""

    status: int
    message: str
    type: str
    reason: str
    code: str | None = None
    param: str | None = None
    retry_after: int | None = None


@dataclass
class Plan:
    """What a request asks for, read once from its body, and where it may go."""

    key: ApiKey
    path: str
    raw: bytes  # the body as the engine gets it
    endpoints: tuple[str, ...]
    route: RoutedModel
    stream: bool
    limited: bool  # the key has limits: the request is admitted before it is sent
    cost: int  # tokens reserved for the key's token limit
    prefix: bytes | None  # for prefix routing


class Proxy:
    """The ASGI handler of the proxied OpenAI paths of one router."""

    def __init__(self, router: Router, clock: Callable[[], float] = time.perf_counter) -> None:
        self.router = router
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ex, authorization, declared = self.exchange(scope)
        await self.run(ex, self._handle(ex, scope, receive, send, authorization, declared))

    def exchange(self, scope: Scope) -> tuple[Exchange, str | None, bytes]:
        """A new exchange for a request, its Authorization header and its Content-Length."""
        started = self.clock()
        request_id = authorization = None
        declared = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"content-length":
                declared = value
            elif name == b"x-request-id":
                request_id = value.decode("latin-1")[:200]
        ex = Exchange(request_id or f"{random.getrandbits(128):032x}", started)
        return ex, authorization, declared

    async def run(self, ex: Exchange, work: Awaitable[None]) -> None:
        """Run `work`, which answers `ex`'s client, then count the exchange."""
        try:
            await work
        except _ClientGone:
            ex.client_gone = True
        except _Broken:
            pass  # the connection closes short of the promised length; the status counts
        self.finish(ex)

    def finish(self, ex: Exchange) -> None:
        """Count an exchange that has ended, in the metrics and the key's usage."""
        if ex.client_gone:
            metrics = self.router.metrics
            metrics.child(metrics.cancellations, ex.model).inc()
            log.debug("the client of %s went away; cancelled upstream", ex.request_id)
        else:
            self._account(ex)
        if ex.key is not None:
            usage = ex.scanner.usage if ex.scanner is not None else None
            self.router.ledger.count(ex.key, ex.model, self.router.wall(), usage, ex.status >= 400)

    async def _handle(
        self,
        ex: Exchange,
        scope: Scope,
        receive: Receive,
        send: Send,
        authorization: str | None,
        declared: bytes,
    ) -> None:
        key = self.check_key(authorization)
        if isinstance(key, Refusal):
            await self.refuse(ex, send, key)
            return
        raw = await _read_body(receive, self.router.config.max_body_bytes, declared)
        got = self.too_large() if raw is None else self.plan(ex, key, scope["path"], raw)
        if isinstance(got, Refusal):
            await self.refuse(ex, send, got)
            return
        await self.serve(ex, scope, receive, send, got)

    def check_key(self, authorization: str | None) -> ApiKey | Refusal:
        """The client's key, or the 401 for a missing, unknown or expired one."""
        router = self.router
        key = router.keys.check(authorization, router.wall())
        if isinstance(key, str):
            return Refusal(401, key, "invalid_request_error", "invalid-key", code="invalid_api_key")
        return key

    def too_large(self) -> Refusal:
        limit = self.router.config.max_body_bytes
        return Refusal(
            413,
            f"The request body is larger than this router takes ({limit} bytes).",
            "invalid_request_error",
            "too-large",
            code="request_too_large",
        )

    def plan(self, ex: Exchange, key: ApiKey, path: str, raw: bytes) -> Plan | Refusal:
        """Read the request's body once: its model, where it may go, what the engine is sent;
        or why it is refused. Records the model and the key on `ex`."""
        router = self.router
        try:
            body = parse_body(raw)
        except BadRequest as exc:
            return Refusal(400, str(exc), "invalid_request_error", "invalid", param=exc.param)
        ex.model = model = body["model"]
        ex.key = key.name
        if path != "/v1/embeddings":
            try:
                check_generation(body)
            except BadRequest as exc:
                return Refusal(400, str(exc), "invalid_request_error", "invalid", param=exc.param)
        table = router.table  # taken once: a swap during this request is invisible to it
        endpoints = table.models.get(model)
        if endpoints is None and router.awaiting_table:
            return Refusal(
                503,
                "This router has no routing table yet (it has just started); try again shortly.",
                "server_error",
                "no-table",
                retry_after=1,
            )
        if endpoints is None or not key.allows(model):
            return Refusal(
                404,
                f"The model `{model}` does not exist or you do not have access to it.",
                "invalid_request_error",
                "unknown-model",
                code="model_not_found",
                param="model",
            )
        route = table.routes[model]
        if path != "/v1/embeddings" and route.max_tokens_cap is not None:
            try:
                raw = _capped(body, raw, route)
            except BadRequest as exc:
                return Refusal(
                    400,
                    str(exc),
                    "invalid_request_error",
                    "over-max-tokens-cap",
                    param=exc.param,
                )
        if not endpoints:
            return Refusal(
                503,
                f"No replica of `{model}` is ready now; try again shortly.",
                "server_error",
                "no-ready-replica",
                retry_after=1,
            )
        stream = body.get("stream") is True
        hide_usage = False
        if stream and path != "/v1/embeddings":
            # Ask the engine for the stream's usage; the client gets it only if it asked too.
            options = body.get("stream_options")
            if not (isinstance(options, dict) and options.get("include_usage") is True):
                raw = asking_usage(body, raw)
                hide_usage = True
        ex.scanner = UsageScanner(stream, hide_usage)
        limited = key.rpm is not None or key.tpm is not None or key.max_concurrent is not None
        prompt = ""  # read only when a limit or the routing needs it
        if path != "/v1/embeddings" and (limited or route.routing == "prefix"):
            prompt = _prompt(body, path)
        cost = (
            _token_estimate(body, prompt, path, router.config.default_max_tokens) if limited else 0
        )
        prefix = None
        if route.routing == "prefix":
            prefix = prompt[: router.config.prefix_chars].encode()
        return Plan(key, path, raw, endpoints, route, stream, limited, cost, prefix)

    async def serve(
        self,
        ex: Exchange,
        scope: Scope,
        receive: Receive,
        send: Send,
        plan: Plan,
        admitted: Ticket | LimitRefusal | None = None,
        tried: list[str] | None = None,
    ) -> None:
        """Admit a planned request under its key's limits (unless `admitted` says how that
        went), then send it to a replica (other than those `tried`) and relay the answer."""
        router = self.router
        ticket = None
        if plan.limited:
            got = admitted
            if got is None:
                got = await router.limits.admit(plan.key, plan.cost, ex.request_id, router.wall())
            if isinstance(got, LimitRefusal):
                await self.refuse(ex, send, self.over_limit(plan, got))
                return
            ticket = got
        await self.guarded(ex, scope, receive, ticket, self._route(ex, send, plan, tried or []))

    async def carry_answer(
        self,
        ex: Exchange,
        scope: Scope,
        receive: Receive,
        send: Send,
        plan: Plan,
        ticket: Ticket | None,
        upstream: Answer,
        endpoint: str,
        first: bytes,
    ) -> None:
        """Relay the rest of an answer whose first bytes have come (the fast lane's answers
        that did not come whole at once)."""

        async def relay() -> None:
            done = False
            try:
                done = await self.answer(ex, send, upstream, endpoint, first, plan.stream)
            finally:
                self.end_attempt(endpoint, upstream, done)

        await self.guarded(ex, scope, receive, ticket, relay())

    async def guarded(
        self,
        ex: Exchange,
        scope: Scope,
        receive: Receive,
        ticket: Ticket | None,
        work: Awaitable[None],
    ) -> None:
        """Run `work`, which talks to engines, and settle the key's reservation at its end.

        From here the client may go away at any await: that cancels this task, and every
        upstream connection is closed on the way out. The lean server says so by a callback;
        under any other server a task waits on `receive()` for the disconnect."""
        task = asyncio.current_task()
        assert task is not None

        def gone() -> None:
            if not ex.finished:
                ex.client_gone = True
                task.cancel()

        extensions = scope.get("extensions")
        on_disconnect = extensions.get(ON_DISCONNECT) if extensions else None
        watcher = None
        if on_disconnect is not None:
            on_disconnect(gone)
        else:
            watcher = asyncio.ensure_future(receive())
            watcher.add_done_callback(_unless_cancelled(gone))
        try:
            await work
        except asyncio.CancelledError:
            if not ex.client_gone:
                raise
            task.uncancel()
        finally:
            ex.finished = True
            if watcher is not None:
                watcher.cancel()
            if ticket is not None:
                self.settle(ex, ticket)

    def settle(self, ex: Exchange, ticket: Ticket) -> None:
        """Settle the key's reservation to what the engine reported, in the background: the
        answer does not wait for the store. When the engine reported nothing, the reservation
        stands if an engine may have worked on the request (the client hung up, the answer
        broke off, or it named no usage), and nothing was used if none did (no engine took
        it, or each that did refused it with an error)."""
        router = self.router
        used = ex.scanner.usage if ex.scanner is not None else None
        if used is not None:
            tokens: int | None = used.total
        else:
            tokens = None if ex.maybe_used else 0
        if router.limits.settle_at_once(ticket, tokens, router.wall()):
            return
        settling = asyncio.ensure_future(router.limits.settle(ticket, tokens, router.wall()))
        router.background.add(settling)
        settling.add_done_callback(router.background.discard)

    def over_limit(self, plan: Plan, refusal: LimitRefusal) -> Refusal:
        if refusal.limit == "store":
            return Refusal(
                503,
                "The router cannot reach its limits store and is set to refuse requests "
                "meanwhile; try again shortly.",
                "server_error",
                "limits-store-unreachable",
                retry_after=1,
            )
        return Refusal(
            429,
            refusal.message(plan.key.name, plan.cost),
            "tokens" if refusal.limit == "tpm" else "requests",
            f"key-{refusal.limit}",
            code="rate_limit_exceeded",
            retry_after=refusal.retry_after_s,
        )

    async def _route(self, ex: Exchange, send: Send, plan: Plan, tried: list[str]) -> None:
        router = self.router
        config = router.config
        route = plan.route
        first_byte = route.first_byte_timeout or config.first_byte_timeout
        while len(tried) <= config.retries:
            endpoint = router.balancer.pick(plan.endpoints, exclude=tried, prefix=plan.prefix)
            if endpoint is None:
                break
            if tried:
                router.metrics.child(router.metrics.retries, ex.model).inc()
            tried.append(endpoint)
            if await self._attempt(ex, send, plan, endpoint, first_byte):
                return
        if not tried:
            await self.refuse(
                ex,
                send,
                Refusal(
                    503,
                    f"Every replica of `{ex.model}` is out of rotation after failing; "
                    "try again shortly.",
                    "server_error",
                    "all-ejected",
                    retry_after=1,
                ),
            )
            return
        log.warning("no replica of %s answered: %s", ex.model, "; ".join(ex.failures))
        if ex.timeouts == len(tried):  # every replica tried was silent: a timeout, not a failure
            await self.refuse(
                ex,
                send,
                Refusal(
                    504,
                    f"No replica of `{ex.model}` answered within {first_byte:g} s "
                    f"({len(tried)} tried).",
                    "server_error",
                    "first-byte-timeout",
                    code="upstream_timeout",
                ),
            )
            return
        await self.refuse(
            ex,
            send,
            Refusal(
                503,
                f"No replica of `{ex.model}` could answer ({len(tried)} tried).",
                "server_error",
                "upstream-failed",
                retry_after=1,
            ),
        )

    def engine_headers(self, ex: Exchange, endpoint: str) -> list[tuple[str, str]]:
        """The headers a request is sent to `endpoint` with."""
        headers = [("content-type", "application/json"), ("x-request-id", ex.request_id)]
        engine_key = self.router.table.keys.get(endpoint)
        if engine_key is not None:
            headers.append(("authorization", engine_key))
        return headers

    async def _attempt(
        self, ex: Exchange, send: Send, plan: Plan, endpoint: str, first_byte: float
    ) -> bool:
        """Send the request to `endpoint`; True when its answer went to the client, False
        when nothing was sent and another replica may be tried."""
        router = self.router
        router.balancer.begin(endpoint)
        upstream: Answer | None = None
        done = False
        try:
            waited = self.clock()
            failure = None
            ex.maybe_used += 1
            try:
                async with asyncio.timeout(first_byte):
                    upstream = await router.upstreams.post(
                        endpoint, plan.path, plan.raw, self.engine_headers(ex, endpoint)
                    )
                    if upstream.status >= 400:
                        ex.maybe_used -= 1  # the engine refused it
                    if upstream.status in RETRY_STATUSES:
                        failure = f"HTTP {upstream.status}"
                    else:
                        first = await upstream.read()
            except TimeoutError:
                failure = f"no first byte within {first_byte:g} s"
                ex.timeouts += 1
            except UpstreamError as exc:
                if exc.unsent:
                    ex.maybe_used -= 1
                failure = f"{type(exc).__name__}: {exc}"[:200]
            ex.upstream_wait += self.clock() - waited
            if failure is not None:
                self.failed(ex, endpoint, failure)
                return False
            assert upstream is not None
            done = await self.answer(ex, send, upstream, endpoint, first, plan.stream)
            return True
        finally:
            self.end_attempt(endpoint, upstream, done)

    def failed(self, ex: Exchange, endpoint: str, failure: str) -> None:
        """`endpoint` gave no answer to relay: noted, and ejected if it keeps failing."""
        router = self.router
        ex.failures.append(f"{endpoint}: {failure}")
        if router.balancer.failed(endpoint, router.now()):
            router.metrics.ejections.labels(endpoint).inc()
            log.warning("endpoint %s ejected after failing again and again", endpoint)

    def end_attempt(self, endpoint: str, upstream: Answer | None, done: bool) -> None:
        """An attempt is over: the endpoint's count drops, and the connection goes back to
        the pool if its answer was read whole, else it is closed, which aborts the request
        at the engine."""
        self.router.balancer.end(endpoint)
        if upstream is not None:
            if done:
                upstream.release()
            else:
                upstream.close()

    async def answer(
        self, ex: Exchange, send: Send, upstream: Answer, endpoint: str, first: bytes, stream: bool
    ) -> bool:
        """Relay an answer whose first bytes have come; True when it was read to its end."""
        ex.first_byte_at = self.clock()
        ex.status = upstream.status
        await self._relay(ex, send, upstream, endpoint, first, stream)
        if upstream.status < 500:
            self.router.balancer.succeeded(endpoint)
        return upstream.at_eof

    def answer_head(
        self, ex: Exchange, upstream: Answer, endpoint: str, stream: bool
    ) -> list[tuple[bytes, bytes]]:
        """The headers the client gets with an engine's answer."""
        headers = [
            (b"content-type", upstream.headers.get("content-type", "application/json").encode()),
            (b"x-request-id", ex.request_id.encode("latin-1")),
            (
                b"x-modelfleet-replica",
                self.router.table.replicas.get(endpoint, endpoint).encode(),
            ),
        ]
        scanner = ex.scanner
        length = upstream.headers.get("content-length")
        if length is not None and not (scanner is not None and scanner.hide):
            headers.append((b"content-length", length.encode()))
        if stream:
            headers += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        if upstream.status in _WHY_STATUSES:
            headers.append((b"x-modelfleet-reason", b"engine"))
            if "retry-after" in upstream.headers:
                headers.append((b"retry-after", upstream.headers["retry-after"].encode()))
        return headers

    async def _relay(
        self,
        ex: Exchange,
        send: Send,
        upstream: Answer,
        endpoint: str,
        first: bytes,
        stream: bool,
    ) -> None:
        router = self.router
        headers = self.answer_head(ex, upstream, endpoint, stream)
        scanner = ex.scanner
        gap = router.config.chunk_timeout
        try:
            await send(
                {"type": "http.response.start", "status": upstream.status, "headers": headers}
            )
            chunk = first
            while chunk:
                # The last chunk, when it is known to be the last, ends the answer: a whole
                # answer in one packet costs one send.
                more = not upstream.at_eof
                out = chunk if scanner is None else scanner.feed(chunk)
                if not more and scanner is not None:
                    out += scanner.finish()
                if out or not more:
                    await send({"type": "http.response.body", "body": out, "more_body": more})
                if not more:
                    return
                waited = self.clock()
                try:
                    async with asyncio.timeout(gap):
                        chunk = await upstream.read()
                except (TimeoutError, UpstreamError) as exc:
                    ex.upstream_wait += self.clock() - waited
                    why = (
                        f"no data for {gap:g} s"
                        if isinstance(exc, TimeoutError)
                        else f"{type(exc).__name__}"
                    )
                    log.warning("answer of %s from %s broke off: %s", ex.model, endpoint, why)
                    if not stream:
                        # Whole answers carry their length: ending the connection short of it
                        # is how the client learns the answer is incomplete.
                        raise _Broken(why) from exc
                    event = error_body(
                        f"The engine stopped answering mid-stream ({why}).",
                        "server_error",
                        code="upstream_stalled",
                    )
                    await send(
                        {
                            "type": "http.response.body",
                            "body": b"data: " + event + b"\n\ndata: [DONE]\n\n",
                            "more_body": False,
                        }
                    )
                    return
                ex.upstream_wait += self.clock() - waited
            tail = b"" if scanner is None else scanner.finish()
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        except OSError as exc:  # uvicorn's ClientDisconnected: the client went away mid-answer
            raise _ClientGone() from exc

    def refusal_answer(
        self, ex: Exchange, refusal: Refusal
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """The status, headers and body of the router's own error answer; counted."""
        body = error_body(refusal.message, refusal.type, refusal.code, refusal.param)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-request-id", ex.request_id.encode("latin-1")),
        ]
        if refusal.status in _WHY_STATUSES:
            headers.append((b"x-modelfleet-reason", refusal.reason.encode()))
        if refusal.retry_after is not None:
            headers.append((b"retry-after", str(refusal.retry_after).encode()))
        ex.status = refusal.status
        metrics = self.router.metrics
        metrics.child(metrics.rejections, refusal.reason).inc()
        return refusal.status, headers, body

    async def refuse(self, ex: Exchange, send: Send, refusal: Refusal) -> None:
        """Answer the request with the router's own OpenAI-style error."""
        status, headers, body = self.refusal_answer(ex, refusal)
        try:
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
        except OSError as exc:
            raise _ClientGone() from exc

    def _account(self, ex: Exchange) -> None:
        end = self.clock()
        first_byte = ex.first_byte_at - ex.started if ex.first_byte_at is not None else None
        own = max(0.0, end - ex.started - ex.upstream_wait)
        self.router.metrics.request_done(ex.model, ex.status, end - ex.started, first_byte, own)


def _unless_cancelled(callback: Callable[[], None]) -> Callable[[asyncio.Future[Any]], None]:
    def done(future: asyncio.Future[Any]) -> None:
        if not future.cancelled():
            callback()

    return done


class _Broken(Exception):
    """An engine's whole answer broke off after its first byte: the client's connection is
    closed short of the length it was promised."""


async def _read_body(receive: Receive, limit: int, declared: bytes) -> bytes | None:
    """The request's body, or None as soon as it is known to be longer than `limit` bytes
    (by its Content-Length, or while it streams in): nothing past the limit is read."""
    if declared.isdigit() and int(declared) > limit:
        return None
    message = await receive()
    if message["type"] != "http.request":
        raise _ClientGone()
    body = message.get("body", b"")
    if not message.get("more_body"):
        return body if len(body) <= limit else None
    parts = [body]
    size = len(body)
    while message.get("more_body"):
        message = await receive()
        if message["type"] != "http.request":
            raise _ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
    return b"".join(parts)


def _prompt(body: dict[str, Any], path: str) -> str:
    """The prompt's text, for prefix routing; empty when it has none that reads as text (the
    engine judges the request, the router only routes it)."""
    try:
        return prompt_text(body, chat=path == "/v1/chat/completions")
    except BadRequest:
        return ""


def _token_estimate(body: dict[str, Any], prompt: str, path: str, default_max: int) -> int:
    """What a request may use at most, for token limits before its usage is known: the
    prompt at about four characters a token, and every choice's `max_tokens`."""
    if path == "/v1/embeddings":
        return len(str(body.get("input", ""))) // 4 + 1
    asked = body.get("max_tokens") or body.get("max_completion_tokens") or default_max
    n = body.get("n") or 1
    if not isinstance(asked, int) or not isinstance(n, int):
        asked, n = default_max, 1
    return len(prompt) // 4 + 1 + asked * max(1, n)


def asking_usage(body: dict[str, Any], raw: bytes) -> bytes:
    """`raw`, the JSON of `body`, asking the engine for the stream's usage
    (`stream_options.include_usage`). A body without `stream_options` gets it spliced in
    before its closing brace: no second encoding of a long prompt per stream."""
    if "stream_options" not in body:
        body["stream_options"] = {"include_usage": True}
        inner = raw.rstrip()[:-1].rstrip()  # a JSON object: its last byte is "}"
        return inner + b',"stream_options":{"include_usage":true}}'
    options = body["stream_options"]
    options = dict(options) if isinstance(options, dict) else {}
    options["include_usage"] = True
    body["stream_options"] = options
    return json.dumps(body).encode()


def _capped(body: dict[str, Any], raw: bytes, route: RoutedModel) -> bytes:
    """The body with `max_tokens` held to the model's cap: a request over it is refused or
    clamped as the catalog says; one that names none is given the cap."""
    cap = route.max_tokens_cap
    assert cap is not None
    changed = False
    named = [k for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    for name in named:
        asked = body[name]
        if not isinstance(asked, int) or isinstance(asked, bool) or asked <= cap:
            continue
        if route.max_tokens_over_cap == "reject":
            raise BadRequest(
                f"'{name}' is {asked}, over this model's cap of {cap}; ask for at most {cap}.",
                param=name,
            )
        body[name] = cap
        changed = True
    if not named:
        body["max_tokens"] = cap
        changed = True
    return json.dumps(body).encode() if changed else raw
