"""The router's data path, where a request comes in: read, checked and planned once, then
handed to a `Flight` (`flight.py`) that carries it to an engine and the answer back.

A request comes one of two ways, and both end in the same `Flight`:

- `take`: the lean server (`http1.py`) hands over a POST whose small body is in whole,
  still inside its parser's callback, before any task is made for it. The flight runs by
  callbacks and gets a task only if it must wait (`Flight.host`).
- `__call__`, a raw ASGI app: any other request (a large body read as it streams in, one
  pipelined behind another, or another server altogether). The flight runs in its task.

What is read, in order: the key (401), the body (413 past `max_body_bytes`, unread), the
JSON parsed once for `model`, `stream`, `max_tokens` and, for token limits, the most tokens
the request can cost (`core/token_bound.py`; 400 for what no engine should be sent), and
where the model may go (404, 503).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from modelfleet.core.token_bound import bounded_output, token_bound
from modelfleet.http.openai_api import BadRequest, check_generation, parse_body, prompt_text
from modelfleet.http.tracing import TRACEPARENT, new_span_id, new_trace_id, parse_traceparent
from modelfleet.router.admit import admission
from modelfleet.router.cold import adapter_failed
from modelfleet.router.exchange import ClientGone, Exchange, Parts, Plan
from modelfleet.router.flight import Flight
from modelfleet.router.limits import Refusal as LimitRefusal
from modelfleet.router.refusal import Refusal, cannot_serve
from modelfleet.router.usage import UsageScanner

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

    from modelfleet.http.http1 import Cycle
    from modelfleet.messages.wire import RoutedModel
    from modelfleet.router.table import ApiKey, KeyRing, RoutingTable

# The lean server's extension by which the proxy learns of a client's disconnect (http1.py).
ON_DISCONNECT = "modelfleet.on_disconnect"

PROXY_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})


class Routes(Protocol):
    """What the router's pushes change, read by each request as it comes in."""

    @property
    def table(self) -> RoutingTable: ...

    @property
    def keys(self) -> KeyRing: ...

    @property
    def awaiting_table(self) -> bool:
        """No table yet but the seed, while one is expected from the control plane."""
        ...


class Proxy:
    """The proxied OpenAI paths of one router: the lean server's `take` and an ASGI app."""

    def __init__(self, parts: Parts, routes: Routes) -> None:
        self.parts = parts
        self.routes = routes
        # Bodies being read, by key: a key may not have more read at once than it may have
        # requests at once (`max_concurrent`, else `rpm`). A key limited to one request at a
        # time once made the router hold 30 bodies of 9.5 MiB while each waited for admission.
        self.reading: dict[str, int] = {}

    def take(self, cycle: Cycle) -> bool:
        """Carry a POST whose whole body is in, from the lean server's callback; False: not
        a proxied path."""
        scope = cycle.scope
        path = scope["path"]
        if path not in PROXY_PATHS:
            return False
        ex, authorization, _ = self.exchange(scope)
        flight = Flight(self.parts, ex, _LeanClient(cycle), in_task=False)
        raw = cycle.take_body()
        key = self.check_key(authorization)
        if isinstance(key, Refusal):
            got: Plan | Refusal = key
        elif len(raw) > self.parts.settings.max_body_bytes:
            got = self.too_large()
        else:
            got = self.plan(ex, key, path, raw)
        try:
            flight.begin(got)
        except Exception:
            flight.failed_in_callback()
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ex, authorization, declared = self.exchange(scope)
        flight = Flight(self.parts, ex, _AsgiClient(scope, receive, send), in_task=True)
        key = self.check_key(authorization)
        got: Plan | Refusal
        if isinstance(key, Refusal):
            got = key
        elif (busy := self.reading_too_many(key)) is not None:
            got = busy
        else:
            self.reading[key.name] = self.reading.get(key.name, 0) + 1
            try:
                raw = await _read_body(receive, self.parts.settings.max_body_bytes, declared)
            except ClientGone:
                flight.gone()
                return
            finally:
                left = self.reading.pop(key.name) - 1
                if left:
                    self.reading[key.name] = left
            got = self.too_large() if raw is None else self.plan(ex, key, scope["path"], raw)
        flight.begin(got)
        await flight.host()

    def reading_too_many(self, key: ApiKey) -> Refusal | None:
        """429 before a body is read when the key already has as many bodies being read as
        it may have requests at once; None: read it."""
        bound = key.max_concurrent if key.max_concurrent is not None else key.rpm
        if bound is None or self.reading.get(key.name, 0) < bound:
            return None
        limit = "max_concurrent" if key.max_concurrent is not None else "rpm"
        got = admission(LimitRefusal(limit, bound, 1.0), key.name, 0)
        assert isinstance(got, Refusal)
        return got

    def exchange(self, scope: Scope) -> tuple[Exchange, str | None, bytes]:
        """A new exchange for a request, its Authorization header and its Content-Length."""
        started = self.parts.clock()
        request_id = authorization = parent = None
        declared = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"content-length":
                declared = value
            elif name == b"x-request-id":
                request_id = value.decode("latin-1")[:200]
            elif name == TRACEPARENT:
                parent = parse_traceparent(value)
        ex = Exchange(
            request_id or f"{random.getrandbits(128):032x}",
            started,
            trace_id=new_trace_id() if parent is None else parent.trace_id,
            span_id=new_span_id(),
            caller_span=None if parent is None else parent.span_id,
            sampled=True if parent is None else parent.sampled,
            path=scope["path"],
        )
        return ex, authorization, declared

    def check_key(self, authorization: str | None) -> ApiKey | Refusal:
        """The client's key, or the 401 for a missing, unknown or expired one."""
        key = self.routes.keys.check(authorization, self.parts.wall())
        if isinstance(key, str):
            return Refusal(401, key, "invalid_request_error", "invalid-key", code="invalid_api_key")
        return key

    def too_large(self) -> Refusal:
        limit = self.parts.settings.max_body_bytes
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
        settings = self.parts.settings
        try:
            body = parse_body(raw)
        except BadRequest as exc:
            return Refusal(400, str(exc), "invalid_request_error", "invalid", param=exc.param)
        # The model is recorded on `ex` (metric labels, usage rows) only once the table knows
        # it: any name a key holder sends once became a label and a usage row for good.
        model = body["model"]
        ex.key = key.name
        if path != "/v1/embeddings":
            try:
                check_generation(body)
            except BadRequest as exc:
                return Refusal(400, str(exc), "invalid_request_error", "invalid", param=exc.param)
        routes = self.routes
        table = routes.table
        endpoints = table.models.get(model)
        if endpoints is None and (adapter := table.adapter_alias(model)) is not None:
            # "base:adapter": the engine knows the adapter by its own name.
            body["model"] = model = adapter
            raw = json.dumps(body).encode()
            endpoints = table.models.get(model)
        if endpoints is None and routes.awaiting_table:
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
        ex.model = model
        route = table.routes[model]
        if model in table.parents:
            self.parts.asked.note(model, self.parts.clock())
        if not endpoints and (failed := adapter_failed(table, model) or cannot_serve(route)):
            return failed  # none is on its way: neither held nor told to try again shortly
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
        if not endpoints and route.target_in_flight is None:  # else it is held (`cold.py`)
            return Refusal(
                503,
                f"No replica of `{model}` is ready now; try again shortly.",
                "server_error",
                "no-ready-replica",
                retry_after=1,
            )
        if key.tpm is not None and path != "/v1/embeddings":
            # The output bound reserved is the one the engine is held to (`token_bound.py`).
            raw = bounded_output(body, raw, settings.default_max_tokens)
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
        cost = token_bound(body, path, settings.default_max_tokens) if key.tpm is not None else 0
        prefix = None
        if route.routing == "prefix":
            prompt = _prompt(body, path) if path != "/v1/embeddings" else ""
            prefix = prompt[: settings.prefix_chars].encode()
        return Plan(key, path, raw, table, endpoints, route, stream, limited, cost, prefix)


class _LeanClient:
    """The client of a request the lean server handed over (`Proxy.take`)."""

    __slots__ = ("cycle", "send")

    def __init__(self, cycle: Cycle) -> None:
        self.cycle = cycle
        self.send = cycle.send

    def answer(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, more: bool
    ) -> bool:
        self.cycle.answer(status, headers, body, more)
        return True

    def on_disconnect(self, callback: Callable[[], None] | None) -> None:
        self.cycle.call_on_disconnect(callback)

    def host(self, run: Coroutine[Any, Any, None]) -> None:
        self.cycle.carry_on(lambda _receive, _send: run)


class _AsgiClient:
    """The client of a request that came through ASGI (`Proxy.__call__`). Under the lean
    server a disconnect is told by a callback; under any other a task waits on `receive()`
    for it."""

    __slots__ = ("receive", "scope", "send", "watcher")

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scope = scope
        self.receive = receive
        self.send = send
        self.watcher: asyncio.Future[Any] | None = None

    def answer(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, more: bool
    ) -> bool:
        return False  # an ASGI answer is sent by awaiting `send`

    def on_disconnect(self, callback: Callable[[], None] | None) -> None:
        extensions = self.scope.get("extensions")
        on_disconnect = extensions.get(ON_DISCONNECT) if extensions else None
        if on_disconnect is not None:
            on_disconnect(callback)
            return
        if self.watcher is not None:
            self.watcher.cancel()
            self.watcher = None
        if callback is not None:
            self.watcher = asyncio.ensure_future(self.receive())
            self.watcher.add_done_callback(_unless_cancelled(callback))

    def host(self, run: Coroutine[Any, Any, None]) -> None:
        raise AssertionError("an ASGI request runs its flight in its own task")


def _unless_cancelled(callback: Callable[[], None]) -> Callable[[asyncio.Future[Any]], None]:
    def done(future: asyncio.Future[Any]) -> None:
        if not future.cancelled():
            callback()

    return done


async def _read_body(receive: Receive, limit: int, declared: bytes) -> bytes | None:
    """The request's body, or None as soon as it is known to be longer than `limit` bytes
    (by its Content-Length, or while it streams in): nothing past the limit is read."""
    if declared.isdigit() and int(declared) > limit:
        return None
    message = await receive()
    if message["type"] != "http.request":
        raise ClientGone()
    body = message.get("body", b"")
    if not message.get("more_body"):
        return body if len(body) <= limit else None
    parts = [body]
    size = len(body)
    while message.get("more_body"):
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone()
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
