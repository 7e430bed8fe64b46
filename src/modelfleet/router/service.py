"""The router: the only client-facing listener, OpenAI-compatible, with API keys.

Two listeners. The client API (`/v1/models`, `/v1/chat/completions`, `/v1/completions`,
`/v1/embeddings`) proxies each request to a ready replica of the model it names
(`proxy.py`, chosen by `balancer.py`). The push API (`PUT /v1/routing`, admin token) takes the
whole routing table from the control plane and serves `/metrics` (same token: the metrics
name engine addresses, which no client of the client API is to see). The router also seeds
its table from its own config, so it serves before the first push and with no control plane
at all. In the background it reads each engine's queue depth and probes ejected engines
(`engine_watch.py`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import ssl
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from modelfleet.core.autoscale import pressure
from modelfleet.host.clock import wait_set
from modelfleet.host.files import sweep_owned, write_json_atomic
from modelfleet.host.processes import die_with_parent
from modelfleet.http.http1 import Bounds
from modelfleet.http.openai_api import error_response
from modelfleet.http.serving import Listener, run_service
from modelfleet.http.tracing import SpanSink
from modelfleet.http.web import json_response
from modelfleet.messages.wire import (
    Ejection,
    EngineClient,
    LoadReport,
    ModelLoad,
    RoutingAck,
    RoutingSnapshot,
    UsageAck,
    UsageReport,
)
from modelfleet.router.balancer import Balancer
from modelfleet.router.cold import ColdHold
from modelfleet.router.config import WORKERS_TEMP_PREFIX, RouterConfig
from modelfleet.router.engine_watch import EngineWatch
from modelfleet.router.exchange import Parts, Settings
from modelfleet.router.limits import Limits, MemoryLimits, RedisLimits
from modelfleet.router.metrics import RouterMetrics, WorkerCounts
from modelfleet.router.proxy import PROXY_PATHS, Proxy
from modelfleet.router.push import create_push_app
from modelfleet.router.table import ApiKey, KeyRing, RoutingTable
from modelfleet.router.upstream import Upstreams
from modelfleet.router.usage import UsageLedger
from modelfleet.security.pki import (
    Issued,
    PkiError,
    client_context_with,
    node_host,
)

log = logging.getLogger("modelfleet.router")
LOAD_WATCH_S = 0.1  # how often a model's load is compared with its target (`watch_load`)


class Router:
    """The router's state: the current table, its keys, and its upstream connections."""

    def __init__(
        self,
        config: RouterConfig,
        now: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.now = now  # the clock of ejections
        self.wall = wall  # the clock of key expiry
        self._own_keys = [k.to_key() for k in config.api_keys]
        seed = self._restore() or RoutingSnapshot(version=0, models=config.models)
        self.upstreams = Upstreams(config.connect_timeout)  # the data path's connections
        self._engine_client: EngineClient | None = None
        self._engine_tls: ssl.SSLContext | None = None
        self._engine_names: dict[str, str] = {}
        self._reach_engines(seed)
        self.snapshot = seed
        self.table = RoutingTable.from_snapshot(seed)
        self.keys = self._key_ring(seed)
        self.restored = seed.version > 0  # it holds what was pushed before it restarted
        self.pushed = False  # whether it holds a table pushed to this run of it
        self.balancer = Balancer()
        self.engine_cache: dict[str, float] = {}  # endpoint -> its KV cache in use, last read
        self.cold = ColdHold(self.balancer, lambda: self.table)
        self.metrics = RouterMetrics(
            in_flight=self.balancer.in_flight, held=lambda: self.cold.held_total
        )
        self.counts = WorkerCounts(config.counts_file) if config.counts_file else None
        self.limits: Limits = (
            RedisLimits.from_url(config.limits_store, config.limits_fail == "open")
            if config.limits_store
            else MemoryLimits()
        )
        self.background: set[asyncio.Future[None]] = set()  # settlements under way
        self.ledger = UsageLedger()  # what each key used, until the control plane collects it
        self.spans: SpanSink | None = None
        if config.otlp_endpoint is not None:
            from modelfleet.http.otlp import OtlpSink  # the SDK, loaded only when spans are sent

            self.spans = OtlpSink(config.otlp_endpoint, "modelfleet-router")
        self.parts = Parts(  # what the data path uses of all this
            Settings(
                max_body_bytes=config.max_body_bytes,
                first_byte_timeout=config.first_byte_timeout,
                chunk_timeout=config.chunk_timeout,
                retries=config.retries,
                prefix_chars=config.prefix_chars,
                default_max_tokens=config.default_max_tokens,
            ),
            self.balancer,
            self.cold,
            self.upstreams,
            self.limits,
            self.metrics,
            self.ledger,
            clock=time.perf_counter,
            now=now,
            wall=wall,
            background=self.background,
            spans=self.spans,
            clock_to_epoch=time.time() - time.perf_counter(),
        )
        self._session: aiohttp.ClientSession | None = None  # scrapes and probes
        self.engines = EngineWatch(self)  # each engine's load read, the ejected ones probed

    def _restore(self) -> RoutingSnapshot | None:
        path = self.config.table_file
        if path is None:
            return None
        try:
            return RoutingSnapshot.model_validate_json(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning(
                "cannot read the last routing table from %s (%s); starting without", path, exc
            )
            return None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout)
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=15)
            self._session = aiohttp.ClientSession(
                timeout=timeout, connector=connector, auto_decompress=False
            )
        return self._session

    async def close(self) -> None:
        self.upstreams.close()
        if self.background:
            await asyncio.wait(self.background, timeout=2)
        await self.limits.close()
        if self.spans is not None:
            await asyncio.to_thread(self.spans.close)  # sends what it still holds
        if self._session is not None:
            await self._session.close()

    def apply(self, snapshot: RoutingSnapshot) -> bool:
        """Swap in `snapshot` unless it is older than the one held, by (epoch, version): a
        table of a newer control-plane epoch is always taken. Returns whether it was."""
        held = (self.snapshot.epoch, self.snapshot.version)
        if (self.pushed or self.restored) and (snapshot.epoch, snapshot.version) < held:
            log.warning(
                "refused a table of routing epoch %d version %d: holds epoch %d version %d "
                "(a control plane that stopped leading sent it)",
                snapshot.epoch,
                snapshot.version,
                *held,
            )
            return False
        if snapshot.epoch != held[0] or not self.pushed:
            log.info("took a table of routing epoch %d, version %d", snapshot.epoch,
                     snapshot.version)  # fmt: skip
        self._reach_engines(snapshot)
        self.snapshot = snapshot
        self.table = RoutingTable.from_snapshot(snapshot)
        self.keys = self._key_ring(snapshot)
        self.balancer.keep_only(self.table.endpoints)
        endpoints = set(self.table.endpoints)
        self.engine_cache = {e: c for e, c in self.engine_cache.items() if e in endpoints}
        self.pushed = True
        if self.config.table_file is not None:
            write_json_atomic(self.config.table_file, snapshot.model_dump(mode="json"))
        self.cold.release_all()
        return True

    def _reach_engines(self, snapshot: RoutingSnapshot) -> None:
        """Take what `snapshot` says of reaching engines behind gates: a new client context
        when the control plane sent another certificate, and each https endpoint's node."""
        client = snapshot.engine_client
        if client != self._engine_client:
            self._engine_client = client
            self._engine_tls = None
            if client is not None:
                try:
                    issued = Issued(client.cert.encode(), client.key.encode())
                    self._engine_tls = client_context_with(client.ca.encode(), issued)
                except PkiError as exc:
                    log.error("cannot use the engine client certificate pushed: %s", exc)
        names = {e: node_host(n) for m in snapshot.models for e, n in m.nodes.items()}
        if names != self._engine_names or self._engine_tls is not self.upstreams.tls:
            self._engine_names = names
            self.upstreams.use_tls(self._engine_tls, names)

    def engine_tls(self, endpoint: str) -> dict[str, Any]:
        """What aiohttp needs to reach `endpoint` (scrapes and probes): for an https one,
        the client context and the node name its certificate must carry."""
        name = self._engine_names.get(endpoint)
        if name is None or self._engine_tls is None:
            return {}
        return {"ssl": self._engine_tls, "server_hostname": name}

    def _key_ring(self, snapshot: RoutingSnapshot) -> KeyRing:
        """The keys of the router's own config and those the control plane pushed."""
        return KeyRing(self._own_keys + [ApiKey.routed(k) for k in snapshot.keys])

    @property
    def awaiting_table(self) -> bool:
        """A router told to expect pushes that has had none yet, and kept none from before it
        restarted, knows only its seed."""
        return self.config.push_token is not None and not (self.pushed or self.restored)

    # -- client API ---------------------------------------------------------------------

    def _authorize(self, request: Request) -> ApiKey | Response:
        key = self.keys.check(request.headers.get("authorization"), self.wall())
        if isinstance(key, str):
            return error_response(401, key, "invalid_request_error", code="invalid_api_key")
        return key

    async def list_models(self, request: Request) -> Response:
        key = self._authorize(request)
        if isinstance(key, Response):
            return key
        table = self.table
        data = [
            _card(name, table.parents.get(name))
            for name in sorted(table.models)
            if key.allows(name)
        ]
        return json_response({"object": "list", "data": data})

    async def get_model(self, request: Request) -> Response:
        key = self._authorize(request)
        if isinstance(key, Response):
            return key
        model = request.path_params["model"]
        if model not in self.table.models or not key.allows(model):
            return _no_model(model)
        return json_response(_card(model, self.table.parents.get(model)))

    async def metrics_text(self) -> bytes:
        own = generate_latest(self.metrics.registry)
        return own if self.counts is None else self.counts.shown(own)

    async def watch_load(self) -> None:
        """Answer the control plane's load poll at once when a model that follows its load
        goes over its target here, or becomes a burst, so that its time over the target is
        counted from then and not from the next poll; runs until cancelled."""
        levels: dict[str, int] = {}
        while True:
            await asyncio.sleep(LOAD_WATCH_S)
            now = self.pressures()
            if any(level > levels.get(model, 0) for model, level in now.items()):
                self.cold.news.set()
            levels = now

    def pressures(self) -> dict[str, int]:
        """How far over its target each model that follows its load is here (`autoscale.
        pressure`; those not over are left out): its requests here, held and in flight at its
        replicas, per serving replica; with none serving, per replica the control plane is
        starting."""
        state, held, table = self.balancer.state, self.cold.counts(), self.table
        levels = {}
        for model, route in table.routes.items():
            target = route.target_in_flight
            if target is None:
                continue
            endpoints = table.models.get(model, ())
            load = held.get(model, 0) + sum(state[e].load for e in endpoints if e in state)
            replicas = len(endpoints) or max(1, route.replicas_wanted or 0)
            if level := pressure(load, replicas, target):
                levels[model] = level
        return levels

    async def health(self, _: Request) -> Response:
        return json_response({"status": "ok", "version": self.snapshot.version})

    # -- push API (`push.py`) ----------------------------------------------------------------

    async def take_table(self, snapshot: RoutingSnapshot, body: bytes) -> RoutingAck:
        applied = self.apply(snapshot)
        held = self.snapshot
        return RoutingAck(applied=applied, epoch=held.epoch, version=held.version)

    async def held(self) -> RoutingAck:
        held = self.snapshot
        return RoutingAck(applied=self.pushed, epoch=held.epoch, version=held.version)

    async def shown_table(self) -> bytes:
        # The engines' keys stay in the router: whoever holds the push token sees the table.
        shown = self.snapshot.model_dump_json(exclude={"models": {"__all__": {"keys"}}})
        return shown.encode()

    async def load(self, wait: float) -> LoadReport:
        """The load per model; with `wait`, after up to that many seconds, or at once when a
        model with no replica gets its first held request or a model's pressure rises
        (`watch_load`): the control plane's long poll."""
        if wait > 0 and not self.cold.news.is_set():
            await wait_set(self.cold.news, wait)
        self.cold.news.clear()
        return self.load_now()

    def load_now(self) -> LoadReport:
        """Each model's requests in flight and held here, and its engines' own counts."""
        state = self.balancer.state
        held, waited = self.cold.counts(), self.cold.waited()
        asked = self.parts.asked.rates(self.parts.clock())
        models: dict[str, ModelLoad] = {}
        for model, endpoints in self.table.models.items():
            if model in self.table.parents:
                # An adapter's replicas are its base's: their counts are the base's. What the
                # control plane needs of an adapter is how much it is asked for, and the
                # requests held for it and for how long.
                if model in held or model in asked:
                    models[model] = ModelLoad(
                        held=held.get(model, 0),
                        rate=asked.get(model, 0.0),
                        waited=waited.get(model, 0.0),
                    )
                continue
            in_flight = engines = 0
            replicas: dict[str, tuple[int, int]] = {}
            cache: dict[str, float] = {}
            for endpoint in endpoints:
                seen = state.get(endpoint)
                if seen is None:
                    continue
                in_flight += seen.in_flight
                engines += seen.engine_load
                rid = self.table.replicas.get(endpoint)
                if rid is not None:
                    replicas[rid] = (seen.in_flight, seen.engine_load)
                    if endpoint in self.engine_cache:
                        cache[rid] = self.engine_cache[endpoint]
            if in_flight or engines or model in held or replicas:
                models[model] = ModelLoad(
                    in_flight=in_flight,
                    held=held.get(model, 0),
                    engines=engines,
                    replicas=replicas,
                    cache=cache,
                )
        return LoadReport(models=models, ejected=self.ejected())

    def ejected(self) -> dict[str, Ejection]:
        """The replicas this router has taken out of rotation, by replica id."""
        now, found = self.now(), {}
        for endpoint, seen in self.balancer.state.items():
            rid = self.table.replicas.get(endpoint)
            if seen.ejected_until is None or rid is None:
                continue
            found[rid] = Ejection(
                why=seen.ejected_why or "it failed again and again",
                left_s=max(0.0, seen.ejected_until - now),
                times=max(1, seen.ejections),
            )
        return found

    async def usage(self) -> UsageReport:
        batch = self.ledger.take()
        return UsageReport(batches=[batch] if batch is not None else [])

    async def ack_usage(self, ack: UsageAck) -> None:
        for run, batch in ack.batches:
            self.ledger.ack(run, batch)


def _card(model: str, parent: str | None = None) -> dict[str, Any]:
    """A model's entry in `/v1/models`; an adapter's names its base as `parent`, as vLLM's."""
    card = {"id": model, "object": "model", "created": 0, "owned_by": "modelfleet"}
    return card if parent is None else {**card, "parent": parent}


def _no_model(model: str) -> Response:
    return error_response(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        "invalid_request_error",
        code="model_not_found",
        param="model",
    )


async def _openai_error(request: Request, exc: Exception) -> Response:
    """An unknown path or a wrong method, answered as OpenAI answers errors."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    what = {404: "Unknown path", 405: "Method not allowed for"}.get(status, "Cannot serve")
    message = f"{what}: {request.method} {request.url.path}"
    return error_response(status, message, "invalid_request_error")


class ClientApp:
    """The client listener: the proxied paths go straight to the proxy, the rest through
    Starlette's routing."""

    def __init__(self, proxy: Proxy, rest: ASGIApp) -> None:
        self.proxy = proxy
        self.rest = rest

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in PROXY_PATHS:
            await self.proxy(scope, receive, send)
        else:
            await self.rest(scope, receive, send)


def create_apps(router: Router) -> tuple[ClientApp, Starlette]:
    """The client-facing app and the push app of one router."""

    post = ["POST"]
    proxy = Proxy(router.parts, router)
    rest = Starlette(
        routes=[
            Route("/health", router.health),
            Route("/v1/models", router.list_models),
            Route("/v1/models/{model:path}", router.get_model),
            *(Route(path, proxy, methods=post) for path in sorted(PROXY_PATHS)),
        ],
        exception_handlers={404: _openai_error, 405: _openai_error},
    )
    return ClientApp(proxy, rest), create_push_app(router, router.config.push_token)


async def watch_parent(parent: int, every: float = 1.0) -> None:
    """A worker whose parent is gone stops as SIGTERM stops it (the kernel's PR_SET_PDEATHSIG
    does the same; this is for a parent whose death it missed)."""
    while os.getppid() == parent:
        await asyncio.sleep(every)
    log.error("router worker: its parent %d is gone; stopping", parent)
    os.kill(os.getpid(), signal.SIGTERM)


async def serve(config: RouterConfig, ready_file: Path | None) -> None:
    """Run a router until SIGINT/SIGTERM."""
    if config.parent_pid is None:  # what routers killed before they could remove it left
        for folder in sweep_owned(WORKERS_TEMP_PREFIX):
            log.warning("removed %s, which a router killed before it stopped left", folder)
    if config.workers > 1:
        from modelfleet.router.workers import serve_workers

        if config.limits_store is None:
            log.warning(
                "%d workers count keys' limits each in its own memory, so a key gets up to "
                "%d times its limits: set limits_store to a Redis URL to share the counts",
                config.workers,
                config.workers,
            )

        data = config.model_dump(mode="json", exclude_defaults=True)
        # The workers' config files hold the keys' hashes only.
        data["api_keys"] = [
            {**k.model_dump(exclude={"key", "sha256"}), "sha256": k.to_key().sha256}
            for k in config.api_keys
        ]
        await serve_workers(data, config, ready_file)
        return
    loops: list[Callable[[], Coroutine[Any, Any, None]]] = []
    parent = config.parent_pid
    if parent is not None:
        if not die_with_parent(parent):
            log.error("router worker: its parent %d is gone; stopping", parent)
            return
        loops.append(lambda: watch_parent(parent))
    router = Router(config)
    client, push = create_apps(router)
    listeners = [
        Listener(
            "router",
            client,
            config.host,
            config.port,
            reuse_port=config.reuse_port,
            tls=config.client_tls,
            take=client.proxy.take,
            bounds=Bounds(
                head_timeout=config.client_head_timeout,
                body_timeout=config.client_body_timeout,
                write_timeout=config.client_write_timeout,
                max_connections=config.max_connections,
            ),
        ),
        Listener("push", push, config.push_host, config.push_port, tls=config.push_tls),
    ]
    await run_service(
        listeners,
        ready_file=ready_file,
        loops=[router.engines.run, router.watch_load, *loops],
        on_stop=router.close,
    )
