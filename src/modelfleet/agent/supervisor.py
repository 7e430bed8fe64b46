"""Supervising one shard: start its engine, probe it until ready, restart it, stop it.

Each engine runs in its own process group with its output in a log file, so it does not
depend on the agent staying alive. A failure report carries the last lines of that log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from modelfleet.engines import EngineDriver, NoDriver
from modelfleet.wire import MAX_LOG_TAIL_LINES, ShardAssignment, ShardReport, ShardState

log = logging.getLogger("modelfleet.agent")


@dataclass(frozen=True)
class SupervisorSettings:
    engine_host: str = "127.0.0.1"
    probe_interval: float = 0.25
    stop_grace: float = 30.0  # SIGTERM, then SIGKILL after this many seconds
    backoff_base: float = 10.0  # first restart delay; doubles per consecutive failure
    backoff_max: float = 300.0
    healthy_reset: float = 600.0  # this long ready resets the backoff


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def log_tail(path: Path, lines: int = MAX_LOG_TAIL_LINES) -> list[str]:
    """The last `lines` lines of a log file (empty when there is none)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return list(deque(text.splitlines(), maxlen=lines))


def signal_group(pid: int, sig: signal.Signals) -> bool:
    """Send `sig` to the process group led by `pid`; False when it is already gone."""
    try:
        os.killpg(pid, sig)
        return True
    except ProcessLookupError:
        return False


class Shard:
    """One assigned shard on this node and the engine process that serves it."""

    def __init__(
        self,
        assignment: ShardAssignment,
        driver: EngineDriver | NoDriver,
        log_dir: Path,
        settings: SupervisorSettings,
        changed: Callable[[], None],
        http: httpx.AsyncClient,
    ) -> None:
        self.assignment = assignment
        self.driver = driver
        self.settings = settings
        self.log_path = log_dir / f"{assignment.replica_id}-{assignment.rank}.log"
        self._changed = changed
        self._http = http
        self.state = ShardState.STARTING
        self.error = ""
        self.port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.argv: list[str] = []
        self.started_at = 0.0
        self.restarts = 0
        self.startup_s: float | None = None
        # Shard 0 of a replica of several shards picks where its peers meet it, once, so a
        # restart of it keeps the address its peers were given.
        self.dist_port: int | None = None
        if assignment.num_shards > 1 and assignment.rank == 0:
            self.dist_port = free_port(settings.engine_host)
        self.task: asyncio.Task[None] | None = None

    def report(self) -> ShardReport:
        a = self.assignment
        failed = self.state is ShardState.FAILED
        return ShardReport(
            replica_id=a.replica_id,
            model=a.model,
            rank=a.rank,
            num_shards=a.num_shards,
            gpus=a.gpus,
            engine_digest=a.engine_digest,
            state=self.state,
            port=self.port,
            dist_port=self.dist_port,
            pid=self.proc.pid if self.proc else None,
            restarts=self.restarts,
            startup_s=self.startup_s,
            error=self.error,
            log_tail=log_tail(self.log_path) if failed else [],
        )

    @property
    def leader(self) -> str | None:
        """Where this replica's shard 0 meets its peers; None for a replica of one shard."""
        if self.dist_port is not None:
            return f"{self.settings.engine_host}:{self.dist_port}"
        return self.assignment.leader

    def _set(self, state: ShardState, error: str = "") -> None:
        if (state, error) != (self.state, self.error):
            self.state, self.error = state, error
            self._changed()

    def start(self) -> None:
        self.task = asyncio.create_task(self._supervise(), name=f"shard {self.assignment.key}")

    async def _supervise(self) -> None:
        """Start, probe and restart the engine until cancelled."""
        failures = 0
        while True:
            ready_since = await self._run_once()
            if (
                ready_since is not None
                and time.monotonic() - ready_since >= self.settings.healthy_reset
            ):
                failures = 0
            failures += 1
            delay = min(self.settings.backoff_base * 2 ** (failures - 1), self.settings.backoff_max)
            log.warning(
                "shard %s failed (%s); restart in %.0fs", self.assignment.key, self.error, delay
            )
            await asyncio.sleep(delay)
            self.restarts += 1
            self._set(ShardState.STARTING)

    async def _run_once(self) -> float | None:
        """Run the engine once, until it exits or stalls; return when it became ready, if it did."""
        if isinstance(self.driver, NoDriver):
            self._set(ShardState.FAILED, str(self.driver))
            return None
        host = self.settings.engine_host
        self.port = free_port(host)
        try:
            launch = self.driver.launch(self.assignment, host, self.port, self.leader)
        except NoDriver as exc:
            self._set(ShardState.FAILED, str(exc))
            return None
        self.argv = launch.argv
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            try:
                self.proc = subprocess.Popen(
                    launch.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **launch.env},
                    start_new_session=True,
                )
            except OSError as exc:
                self._set(ShardState.FAILED, f"cannot start {launch.argv[0]}: {exc.strerror}")
                return None
        self.started_at = time.time()
        self.startup_s = None
        self._changed()
        log.info(
            "shard %s: started pid %d on port %d", self.assignment.key, self.proc.pid, self.port
        )

        began = time.monotonic()
        deadline = began + self.assignment.startup_timeout
        url = f"http://{host}:{self.port}{self.driver.health_path}"
        ready_since: float | None = None
        while True:
            code = self.proc.poll()
            if code is not None:
                self._set(ShardState.FAILED, f"engine exited with code {code}")
                return ready_since
            if ready_since is None and time.monotonic() > deadline:
                await self._terminate()
                self._set(
                    ShardState.FAILED,
                    f"startup timed out after {self.assignment.startup_timeout:.0f}s",
                )
                return None
            if ready_since is None and await self._probe(url):
                ready_since = time.monotonic()
                self.startup_s = round(ready_since - began, 3)
                self._set(ShardState.READY)
            await asyncio.sleep(self.settings.probe_interval if ready_since is None else 0.5)

    async def _probe(self, url: str) -> bool:
        try:
            response = await self._http.get(url, timeout=2.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def _terminate(self) -> None:
        """SIGTERM the engine's process group, then SIGKILL it after the grace period."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.settings.stop_grace
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if proc.poll() is None:
            log.warning(
                "shard %s: pid %d ignored SIGTERM; killing it", self.assignment.key, proc.pid
            )
            signal_group(proc.pid, signal.SIGKILL)
            while proc.poll() is None:
                await asyncio.sleep(0.05)

    async def stop(self) -> None:
        """Stop supervising and stop the engine (it finishes in-flight requests first)."""
        self._set(ShardState.STOPPING)
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self._terminate()
