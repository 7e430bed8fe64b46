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
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modelfleet.openai_api import BadRequest, error_body, parse_body, prompt_text
from modelfleet.router.limits import Refusal, Ticket
from modelfleet.router.upstream import Answer, UpstreamError
from modelfleet.router.usage import UsageScanner

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

    from modelfleet.router.service import Router
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
class _Exchange:
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


class Proxy:
    """The ASGI handler of the proxied OpenAI paths of one router."""

    def __init__(self, router: Router, clock: Callable[[], float] = time.perf_counter) -> None:
        self.router = router
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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
        ex = _Exchange(request_id or f"{random.getrandbits(128):032x}", started)
        try:
            await self._handle(ex, scope, receive, send, authorization, declared)
        except _ClientGone:
            ex.client_gone = True
        except _Broken:
            pass  # the connection closes short of the promised length; the status counts
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
        ex: _Exchange,
        scope: Scope,
        receive: Receive,
        send: Send,
        authorization: str | None,
        declared: bytes,
    ) -> None:
        router = self.router
        key = router.keys.check(authorization, router.wall())
        if isinstance(key, str):
            await self._refuse(
                ex,
                send,
                401,
                key,
                "invalid_request_error",
                code="invalid_api_key",
                reason="invalid-key",
            )
            return
        limit = router.config.max_body_bytes
        raw = await _read_body(receive, limit, declared)
        if raw is None:
            await self._refuse(
                ex,
                send,
                413,
                f"The request body is larger than this router takes ({limit} bytes).",
                "invalid_request_error",
                code="request_too_large",
                reason="too-large",
            )
            return
        path: str = scope["path"]
        try:
            body = parse_body(raw)
            prompt = _prompt(body, path) if path != "/v1/embeddings" else ""
        except BadRequest as exc:
            await self._refuse(
                ex, send, 400, str(exc), "invalid_request_error", param=exc.param, reason="invalid"
            )
            return
        ex.model = model = body["model"]
        ex.key = key.name
        table = router.table  # taken once: a swap during this request is invisible to it
        endpoints = table.models.get(model)
        if endpoints is None and router.awaiting_table:
            await self._refuse(
                ex,
                send,
                503,
                "This router has no routing table yet (it has just started); try again shortly.",
                "server_error",
                retry_after=1,
                reason="no-table",
            )
            return
        if endpoints is None or not key.allows(model):
            await self._refuse(
                ex,
                send,
                404,
                f"The model `{model}` does not exist or you do not have access to it.",
                "invalid_request_error",
                code="model_not_found",
                param="model",
                reason="unknown-model",
            )
            return
        route = table.routes[model]
        if path != "/v1/embeddings" and route.max_tokens_cap is not None:
            try:
                raw = _capped(body, raw, route)
            except BadRequest as exc:
                await self._refuse(
                    ex,
                    send,
                    400,
                    str(exc),
                    "invalid_request_error",
                    param=exc.param,
                    reason="over-max-tokens-cap",
                )
                return
        if not endpoints:
            await self._refuse(
                ex,
                send,
                503,
                f"No replica of `{model}` is ready now; try again shortly.",
                "server_error",
                retry_after=1,
                reason="no-ready-replica",
            )
            return
        stream = body.get("stream") is True
        hide_usage = False
        if stream and path != "/v1/embeddings":
            # Ask the engine for the stream's usage; the client gets it only if it asked too.
            options = body.get("stream_options")
            if not (isinstance(options, dict) and options.get("include_usage") is True):
                raw = asking_usage(body, raw)
                hide_usage = True
        ex.scanner = UsageScanner(stream, hide_usage)
        ticket = None
        if key.rpm is not None or key.tpm is not None or key.max_concurrent is not None:
            cost = _token_estimate(body, prompt, path, router.config.default_max_tokens)
            got = await router.limits.admit(key, cost, ex.request_id, router.wall())
            if isinstance(got, Refusal):
                await self._over_limit(ex, send, key.name, got, cost)
                return
            ticket = got
        prefix = None
        if route.routing == "prefix":
            prefix = prompt[: router.config.prefix_chars].encode()

        # From here the client may go away at any await: that cancels this task, and every
        # upstream connection is closed on the way out. The lean server says so by a
        # callback; under any other server a task waits on `receive()` for the disconnect.
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
            await self._route(ex, send, raw, path, endpoints, route, prefix, stream)
        except asyncio.CancelledError:
            if not ex.client_gone:
                raise
            task.uncancel()
        finally:
            ex.finished = True
            if watcher is not None:
                watcher.cancel()
            if ticket is not None:
                self._settle(ex, ticket)

    def _settle(self, ex: _Exchange, ticket: Ticket) -> None:
        """Settle the key's reservation to what the engine reported, in the background: the
        answer does not wait for the store. No engine answered: nothing was used."""
        router = self.router
        used = ex.scanner.usage if ex.scanner is not None else None
        tokens = used.total if used is not None else (0 if ex.first_byte_at is None else None)
        if router.limits.settle_at_once(ticket, tokens, router.wall()):
            return
        settling = asyncio.ensure_future(router.limits.settle(ticket, tokens, router.wall()))
        router.background.add(settling)
        settling.add_done_callback(router.background.discard)

    async def _over_limit(
        self, ex: _Exchange, send: Send, key: str, refusal: Refusal, cost: int
    ) -> None:
        if refusal.limit == "store":
            await self._refuse(
                ex,
                send,
                503,
                "The router cannot reach its limits store and is set to refuse requests "
                "meanwhile; try again shortly.",
                "server_error",
                retry_after=1,
                reason="limits-store-unreachable",
            )
            return
        await self._refuse(
            ex,
            send,
            429,
            refusal.message(key, cost),
            "tokens" if refusal.limit == "tpm" else "requests",
            code="rate_limit_exceeded",
            retry_after=refusal.retry_after_s,
            reason=f"key-{refusal.limit}",
        )

    async def _route(
        self,
        ex: _Exchange,
        send: Send,
        raw: bytes,
        path: str,
        endpoints: tuple[str, ...],
        route: RoutedModel,
        prefix: bytes | None,
        stream: bool,
    ) -> None:
        router = self.router
        config = router.config
        first_byte = route.first_byte_timeout or config.first_byte_timeout
        tried: list[str] = []
        while len(tried) <= config.retries:
            endpoint = router.balancer.pick(endpoints, exclude=tried, prefix=prefix)
            if endpoint is None:
                break
            if tried:
                router.metrics.child(router.metrics.retries, ex.model).inc()
            tried.append(endpoint)
            if await self._attempt(ex, send, raw, path, endpoint, first_byte, stream):
                return
        if not tried:
            await self._refuse(
                ex,
                send,
                503,
                f"Every replica of `{ex.model}` is out of rotation after failing; "
                "try again shortly.",
                "server_error",
                retry_after=1,
                reason="all-ejected",
            )
            return
        log.warning("no replica of %s answered: %s", ex.model, "; ".join(ex.failures))
        if ex.timeouts == len(tried):  # every replica tried was silent: a timeout, not a failure
            await self._refuse(
                ex,
                send,
                504,
                f"No replica of `{ex.model}` answered within {first_byte:g} s "
                f"({len(tried)} tried).",
                "server_error",
                code="upstream_timeout",
                reason="first-byte-timeout",
            )
            return
        await self._refuse(
            ex,
            send,
            503,
            f"No replica of `{ex.model}` could answer ({len(tried)} tried).",
            "server_error",
            retry_after=1,
            reason="upstream-failed",
        )

    async def _attempt(
        self,
        ex: _Exchange,
        send: Send,
        raw: bytes,
        path: str,
        endpoint: str,
        first_byte: float,
        stream: bool,
    ) -> bool:
        """Send the request to `endpoint`; True when its answer went to the client, False
        when nothing was sent and another replica may be tried."""
        router = self.router
        balancer, metrics = router.balancer, router.metrics
        headers = [("content-type", "application/json"), ("x-request-id", ex.request_id)]
        engine_key = router.table.keys.get(endpoint)
        if engine_key is not None:
            headers.append(("authorization", engine_key))
        balancer.begin(endpoint)
        upstream: Answer | None = None
        done = False
        try:
            waited = self.clock()
            failure = None
            try:
                async with asyncio.timeout(first_byte):
                    upstream = await router.upstreams.post(endpoint, path, raw, headers)
                    if upstream.status in RETRY_STATUSES:
                        failure = f"HTTP {upstream.status}"
                    else:
                        first = await upstream.read()
            except TimeoutError:
                failure = f"no first byte within {first_byte:g} s"
                ex.timeouts += 1
            except UpstreamError as exc:
                failure = f"{type(exc).__name__}: {exc}"[:200]
            now = self.clock()
            ex.upstream_wait += now - waited
            if failure is not None:
                ex.failures.append(f"{endpoint}: {failure}")
                if balancer.failed(endpoint, router.now()):
                    metrics.ejections.labels(endpoint).inc()
                    log.warning("endpoint %s ejected after failing again and again", endpoint)
                return False
            assert upstream is not None
            ex.first_byte_at = now
            ex.status = upstream.status
            await self._relay(ex, send, upstream, endpoint, first, stream)
            done = upstream.at_eof
            if upstream.status < 500:
                balancer.succeeded(endpoint)
            return True
        finally:
            balancer.end(endpoint)
            if upstream is not None:
                if done:
                    upstream.release()
                else:
                    upstream.close()  # the engine sees the disconnect and aborts the request

    async def _relay(
        self,
        ex: _Exchange,
        send: Send,
        upstream: Answer,
        endpoint: str,
        first: bytes,
        stream: bool,
    ) -> None:
        router = self.router
        headers = [
            (b"content-type", upstream.headers.get("content-type", "application/json").encode()),
            (b"x-request-id", ex.request_id.encode("latin-1")),
            (b"x-modelfleet-replica", router.table.replicas.get(endpoint, endpoint).encode()),
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

    async def _refuse(
        self,
        ex: _Exchange,
        send: Send,
        status: int,
        message: str,
        type_: str,
        *,
        reason: str,
        code: str | None = None,
        param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        """Answer the request with the router's own OpenAI-style error."""
        body = error_body(message, type_, code, param)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-request-id", ex.request_id.encode("latin-1")),
        ]
        if status in _WHY_STATUSES:
            headers.append((b"x-modelfleet-reason", reason.encode()))
        if retry_after is not None:
            headers.append((b"retry-after", str(retry_after).encode()))
        ex.status = status
        metrics = self.router.metrics
        metrics.child(metrics.rejections, reason).inc()
        try:
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
        except OSError as exc:
            raise _ClientGone() from exc

    def _account(self, ex: _Exchange) -> None:
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
