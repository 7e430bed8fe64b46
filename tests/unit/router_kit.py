"""What the router's unit tests share: routers in-process, and engines served on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from modelfleet.http.http1 import Http1Server
from modelfleet.http.serving import Listener
from modelfleet.router.config import RouterConfig
from modelfleet.router.service import ClientApp, Router, create_apps


class FakeClock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# Which way `client_of` reaches a router: "proxy", the proxy as an ASGI app in process (its
# flights run in the request's task); or "lane", the lean server on 127.0.0.1 handing each
# request to the proxy's `take` (its flights run by callbacks until they must wait). Tests
# that hold both ways take the `way` fixture (conftest.py), which sets this.
WAY = "proxy"


class LaneTransport(httpx.AsyncBaseTransport):
    """Serves a router's client app on the lean server with the proxy's `take`, on a free port of
    127.0.0.1 from the first request on; every request goes there, whatever its URL."""

    def __init__(self, app: ClientApp) -> None:
        self.app = app
        self.server: Http1Server | None = None
        self.port = 0
        self.inner = httpx.AsyncHTTPTransport()

    async def start(self) -> str:
        if self.server is None:
            listener = Listener("router", self.app)
            sock = listener.bind()
            self.server = Http1Server(self.app, take=self.app.proxy.take)
            await self.server.start(sock)
            self.port = listener.port
        return f"http://127.0.0.1:{self.port}"

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await self.start()
        request.url = request.url.copy_with(scheme="http", host="127.0.0.1", port=self.port)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()
        if self.server is not None:
            await self.server.shutdown(drain_timeout=1)


def client_of(router: Router) -> httpx.AsyncClient:
    """A client of `router`'s client API (the way `WAY` says), with the key its config names."""
    client_app, _ = create_apps(router)
    transport: httpx.AsyncBaseTransport = (
        LaneTransport(client_app) if WAY == "lane" else httpx.ASGITransport(app=client_app)
    )
    return httpx.AsyncClient(
        transport=transport,
        base_url="http://router",
        headers={"authorization": "Bearer client-key"},
    )


@contextlib.asynccontextmanager
async def router_url(router: Router) -> AsyncIterator[str]:
    """`router`'s client API on 127.0.0.1 (uvicorn, or the lean server with the proxy's `take`,
    as `WAY` says); yields its URL."""
    client_app, _ = create_apps(router)
    if WAY != "lane":
        async with serving(client_app) as url:
            yield url
        return
    lane = LaneTransport(client_app)
    try:
        yield await lane.start()
    finally:
        await lane.aclose()


def keyed(
    clock: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
    **config: Any,
) -> Router:
    """A router with one client key, `client-key`, and `config` besides; no engine watching
    unless the test asks for it."""
    config.setdefault("watch_interval", 0)
    config.setdefault("api_keys", [{"name": "k", "key": "client-key"}])
    return Router(RouterConfig(**config), clock, wall)


@contextlib.asynccontextmanager
async def serving(app: ASGIApp) -> AsyncIterator[str]:
    """`app` served on 127.0.0.1 by uvicorn on this event loop; yields its URL."""
    listener = Listener("engine", app)
    sock = listener.bind()
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "the test engine did not start listening"
            await asyncio.sleep(0.01)
        yield listener.url
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def upstream(status: int, hits: list[int]) -> AsyncIterator[str]:
    """An engine on 127.0.0.1 that answers every completion with `status`, counting them,
    and its /health with 200."""

    async def complete(_: Request) -> Response:
        hits.append(status)
        body = {"choices": [{"index": 0, "text": "ok"}]} if status == 200 else {"error": "busy"}
        return JSONResponse(body, status_code=status)

    async def health(_: Request) -> Response:
        return Response(status_code=200)

    app = Starlette(
        routes=[
            Route("/v1/completions", complete, methods=["POST"]),
            Route("/health", health),
        ]
    )
    async with serving(app) as url:
        yield url


def run(test: Coroutine[Any, Any, None], within: float = 30.0) -> None:
    """Run an async test, failing it after `within` seconds rather than letting it hang (a
    router without its timeouts would wait forever)."""

    async def bounded() -> None:
        try:
            async with asyncio.timeout(within):
                await test
        except TimeoutError:
            raise AssertionError(f"the test did not end within {within} s") from None

    asyncio.run(bounded())


async def until(what: str, check: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait, on the event loop, until `check()` holds; fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        await asyncio.sleep(0.01)
