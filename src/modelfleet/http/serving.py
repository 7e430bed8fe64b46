"""Running a service: its listeners, its background loops, and one ordered shutdown.

Every modelfleet process goes through `run_service`. It binds each listener itself (port 0
picks a free port), signals readiness once every listener is accepting by writing a ready file
(JSON: pid and the URL of each listener), and on SIGINT or SIGTERM shuts down in one order:
stop the background loops, stop accepting, let in-flight requests finish (bounded by
`drain_timeout`), then run the service's own `on_stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import resource
import signal
import socket
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvloop

from modelfleet.host.files import write_json_atomic
from modelfleet.http.http1 import Bounds, Cycle, Http1Server
from modelfleet.security.pki import TlsFiles, server_context

log = logging.getLogger("modelfleet")
FILES_RESERVED = 512  # open files a service keeps for what is not a client connection


@dataclass
class Listener:
    """One HTTP listener of a service: a name (used in the ready file), an ASGI app, an address."""

    name: str
    app: Any
    host: str = "127.0.0.1"
    port: int = 0
    # Several processes may listen on the port (each such listener says so): the kernel
    # spreads new connections over them.
    reuse_port: bool = False
    # Gets each small POST before the app does (`Http1Server.take`).
    take: Callable[[Cycle], bool] | None = field(default=None, repr=False)
    # What a client may cost: a slow head or body, its size, the connections (`http1.Bounds`).
    bounds: Bounds = field(default_factory=Bounds)
    sock: socket.socket | None = field(default=None, repr=False)
    # The certificate and key it serves TLS with (`pki.py`); None: plain HTTP.
    tls: TlsFiles | None = None

    def bind(self) -> socket.socket:
        """Bind and listen (port 0: the kernel picks one, which `port` then holds)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # Named TCP, so that asyncio turns Nagle's algorithm off on each connection it accepts,
        # and off on the listening socket too, whose connections inherit it: with Nagle on, a
        # kept-alive client waited about 40 ms for every answer.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((self.host, self.port))
        sock.listen(2048)
        sock.setblocking(False)
        self.sock = sock
        self.port = sock.getsockname()[1]
        return sock

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{host}:{self.port}"


class ServiceFailed(RuntimeError):
    """A part of a service (a background loop, a listener) failed and the service stopped:
    its process exits non-zero, so that whoever supervises it sees a failure."""


def run_fast(main: Coroutine[Any, Any, None]) -> None:
    """Run `main` on uvloop's event loop (for the services on the request path it cut the
    router's CPU per request, bench/router.py). A service that stopped because a part of it
    failed exits with status 1."""
    run_service_loop(main, fast=True)


def fit_to_open_files(listeners: list[Listener], reserve: int = FILES_RESERVED) -> None:
    """Raise this process's open-file limit to its hard limit, and lower the listeners'
    connection caps (in proportion) where together they would pass it, less `reserve` for
    everything else the process opens: a cap above the limit is none (20,100 half-sent
    requests once took every file descriptor of a control plane)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = os.environ.get("MODELFLEET_MAX_OPEN_FILES", "")
    if ceiling.isdigit() and 0 < int(ceiling) < hard:
        # An operator's ceiling (as systemd's LimitNOFILE would set), below the hard limit.
        hard = int(ceiling)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, hard), hard))
        soft = min(soft, hard)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    budget = max(len(listeners) * 16, soft - reserve)
    wanted = sum(li.bounds.max_connections for li in listeners)
    if wanted <= budget:
        return
    for li in listeners:
        cap = max(16, li.bounds.max_connections * budget // wanted)
        li.bounds = dataclasses.replace(li.bounds, max_connections=cap)
    log.info(
        "connection caps lowered to %s, to fit %d open files",
        ", ".join(f"{li.name} {li.bounds.max_connections}" for li in listeners),
        soft,
    )


def run_service_loop(main: Coroutine[Any, Any, None], fast: bool = False) -> None:
    """Run a service's `main` until it returns; exit with status 1 if it stopped because a
    part of it failed (a service that stopped for a failure once exited 0, and a supervisor
    took the crash loop for clean stops)."""
    try:
        if fast:
            uvloop.run(main)
        else:
            asyncio.run(main)
    except ServiceFailed as exc:
        log.error("%s", exc)
        raise SystemExit(1) from None


def configure_logging(level: str = "info") -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # One line per HTTP request of our own clients drowns what the services say.
    logging.getLogger("httpx").setLevel(logging.WARNING)


async def run_service(
    listeners: list[Listener],
    *,
    ready_file: Path | None = None,
    loops: list[Callable[[], Coroutine[Any, Any, None]]] | None = None,
    on_ready: Callable[[], Awaitable[None]] | None = None,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    drain_timeout: float = 30.0,
    ready_extra: dict[str, Any] | None = None,
) -> None:
    """Serve `listeners` and run `loops` until SIGINT/SIGTERM, then shut down in order."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    lean: list[Http1Server] = []
    fit_to_open_files(listeners)
    for listener in listeners:
        sock = listener.sock or listener.bind()
        tls = server_context(listener.tls) if listener.tls is not None else None
        http1 = Http1Server(
            listener.app, take=listener.take, bounds=listener.bounds, tls=tls, name=listener.name
        )
        await http1.start(sock)
        lean.append(http1)

    loop_tasks = [asyncio.create_task(fn()) for fn in loops or []]
    if on_ready is not None:
        await on_ready()
    if ready_file is not None:
        # Each listener's bounds too, so that whoever attacks it (the suite's hostile-client
        # kit) knows the caps it must meet without being told them again.
        ready = {
            "pid": os.getpid(),
            "urls": {li.name: li.url for li in listeners},
            "bounds": {li.name: dataclasses.asdict(li.bounds) for li in listeners},
        }
        ready.update(ready_extra or {})
        write_json_atomic(ready_file, ready)
    for listener in listeners:
        log.info("%s listening on %s", listener.name, listener.url)

    stop_waiter = asyncio.create_task(stop.wait())
    watched: set[asyncio.Task[Any]] = {stop_waiter, *loop_tasks}
    # A background loop with nothing to do returns (the router's engine watch with
    # `watch_interval: 0`): the service goes on. A signal or a loop that fails ends it.
    failure: BaseException | None = None
    while True:
        done, watched = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        ended = [t for t in done if t is stop_waiter or t.cancelled() or t.exception()]
        for task in ended:
            if task is not stop_waiter and not task.cancelled() and task.exception():
                failure = failure or task.exception()
                log.error("a part of the service failed; shutting down", exc_info=task.exception())
        if ended:
            break

    # Ordered shutdown: background loops first (nothing new is started), then the listeners
    # (stop accepting, finish in-flight requests), then the service's own teardown.
    for task in loop_tasks:
        task.cancel()
    await asyncio.gather(*loop_tasks, return_exceptions=True)
    await asyncio.gather(*(h.shutdown(drain_timeout) for h in lean), return_exceptions=True)
    if on_stop is not None:
        await on_stop()
    stop_waiter.cancel()
    if failure is not None:
        raise ServiceFailed(f"stopped because a part of it failed: {failure!r}") from failure
