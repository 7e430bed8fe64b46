"""Supervising one shard: start its engine, probe it until ready, restart it, stop it.

Each engine runs in its own session and process group with its output in a log file, so it
does not depend on the agent staying alive: an agent killed with -9 leaves its engines serving,
and the next run of the agent adopts them from the records it keeps (`Shard.record`). A failure
report carries the last lines of the engine's log.
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
from typing import Any, Protocol

import httpx

from modelfleet.engines import EngineDriver, NoDriver
from modelfleet.wire import MAX_LOG_TAIL_LINES, ShardAssignment, ShardReport, ShardState

log = logging.getLogger("modelfleet.agent")


@dataclass(frozen=True)
class SupervisorSettings:
    engine_host: str = "127.0.0.1"
    probe_interval: float = 0.25  # while starting
    watch_interval: float = 0.5  # once ready: how often its exit is looked for
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


def start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, from /proc), or None when it is gone
    or has exited. With the pid it names one process: a pid can be reused, this pair cannot."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":  # exited, not yet reaped
        return None
    return int(fields[19])


class EngineProcess(Protocol):
    """A running engine: `subprocess.Popen`, or `Adopted` for one an earlier agent started."""

    pid: int

    def poll(self) -> int | None: ...


class Adopted:
    """An engine started by an earlier run of this agent. It is not this process's child, so
    its exit is seen through /proc and its exit code is unknown (reported as -1)."""

    def __init__(self, pid: int, ticks: int) -> None:
        self.pid = pid
        self.ticks = ticks
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and start_ticks(self.pid) != self.ticks:
            self.returncode = -1
        return self.returncode


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
        self.proc: EngineProcess | None = None
        self.argv: list[str] = []
        self.health_path: str | None = "/health"
        self.started_at = 0.0  # wall clock, for the record
        self.restarts = 0
        self.failures = 0  # in a row, since the engine was last healthy long enough
        self.backoff_s: float | None = None  # while failed: the wait before the next start
        self.startup_s: float | None = None
        self.adopted = False
        # Shard 0 of a replica of several shards picks where its peers meet it, once, so a
        # restart of it keeps the address its peers were given.
        self.dist_port: int | None = None
        if assignment.num_shards > 1 and assignment.rank == 0:
            self.dist_port = free_port(settings.engine_host)
        self.task: asyncio.Task[None] | None = None

    # -- what is reported and recorded ---------------------------------------------------

    def report(self) -> ShardReport:
        a = self.assignment
        failed = self.state is ShardState.FAILED
        # The tail of the last failure goes with every report until the engine is ready again,
        # so a crash loop shows its cause also while the next start is under way.
        tail = failed or (self.failures > 0 and self.state is ShardState.STARTING)
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
            failures=self.failures,
            backoff_s=self.backoff_s if failed else None,
            startup_s=self.startup_s,
            error=self.error,
            log_tail=log_tail(self.log_path) if tail else [],
        )

    def record(self) -> dict[str, Any]:
        """What the agent's state dir keeps of this shard: enough for a later run of the agent
        to find its engine again and take it over."""
        pid = self.proc.pid if self.proc else None
        return {
            "assignment": self.assignment.model_dump(),
            "replica_id": self.assignment.replica_id,
            "rank": self.assignment.rank,
            "model": self.assignment.model,
            "pid": pid,
            "start_ticks": start_ticks(pid) if pid else None,
            "port": self.port,
            "dist_port": self.dist_port,
            "argv": self.argv,
            "health_path": self.health_path,
            "started_at": self.started_at,
            "restarts": self.restarts,
            "state": self.state.value,
        }

    def adopt(self, record: dict[str, Any]) -> bool:
        """Take over the engine `record` describes, if that very process still runs."""
        pid, ticks = record.get("pid"), record.get("start_ticks")
        if not isinstance(pid, int) or not isinstance(ticks, int) or start_ticks(pid) != ticks:
            return False
        self.proc = Adopted(pid, ticks)
        self.port = record.get("port")
        self.dist_port = record.get("dist_port") or self.dist_port
        self.argv = list(record.get("argv") or [])
        self.health_path = record.get("health_path")
        self.started_at = float(record.get("started_at") or time.time())
        self.restarts = int(record.get("restarts") or 0)
        self.adopted = True
        return True

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

    # -- supervision ---------------------------------------------------------------------

    def start(self) -> None:
        self.task = asyncio.create_task(self._supervise(), name=f"shard {self.assignment.key}")

    async def _supervise(self) -> None:
        """Run the engine (or watch the adopted one), and restart it after a backoff when it
        fails, until cancelled."""
        while True:
            if self.adopted:
                self.adopted = False
                ready_since = await self._watch()
            else:
                ready_since = await self._watch() if self._spawn() else None
            healthy_for = time.monotonic() - ready_since if ready_since is not None else 0.0
            if healthy_for >= self.settings.healthy_reset:
                self.failures = 0
            self.failures += 1
            delay = self.settings.backoff_base * 2 ** (self.failures - 1)
            self.backoff_s = min(delay, self.settings.backoff_max)
            log.warning(
                "shard %s failed (%s); restart %d in %.0fs",
                self.assignment.key,
                self.error,
                self.restarts + 1,
                self.backoff_s,
            )
            self._changed()
            await asyncio.sleep(self.backoff_s)
            self.restarts += 1
            self.backoff_s = None
            self._set(ShardState.STARTING)

    def _spawn(self) -> bool:
        """Start the engine; False (with the shard failed and why) when it cannot start."""
        if isinstance(self.driver, NoDriver):
            self._set(ShardState.FAILED, str(self.driver))
            return False
        host = self.settings.engine_host
        self.port = free_port(host)
        try:
            launch = self.driver.launch(self.assignment, host, self.port, self.leader)
        except NoDriver as exc:
            self._set(ShardState.FAILED, str(exc))
            return False
        self.argv = launch.argv
        self.health_path = launch.health_path
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
                return False
        self.started_at = time.time()
        self.startup_s = None
        self._changed()
        log.info(
            "shard %s: started pid %d on port %d", self.assignment.key, self.proc.pid, self.port
        )
        return True

    async def _watch(self) -> float | None:
        """Probe the running engine until it is ready, then watch it until it exits; return
        when it became ready (monotonic), or None when it never did. An engine not ready within
        its startup timeout is stopped and the shard fails with "startup timed out"."""
        proc = self.proc
        assert proc is not None
        timeout = self.assignment.startup_timeout
        began = time.monotonic() - max(0.0, time.time() - self.started_at)
        deadline = began + timeout
        url = f"http://{self.settings.engine_host}:{self.port}{self.health_path or ''}"
        ready_since: float | None = None
        while True:
            code = proc.poll()
            if code is not None:
                how = "code unknown: an earlier agent run started it" if code == -1 else code
                self._set(ShardState.FAILED, f"engine exited ({how})")
                return ready_since
            if ready_since is None:
                if time.monotonic() > deadline:
                    await self._terminate()
                    self._set(ShardState.FAILED, f"startup timed out after {timeout:.0f}s")
                    return None
                if self.health_path is None or await self._probe(url):
                    ready_since = time.monotonic()
                    self.startup_s = round(ready_since - began, 3)
                    self._set(ShardState.READY)
            interval = self.settings.probe_interval
            await asyncio.sleep(interval if ready_since is None else self.settings.watch_interval)

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
