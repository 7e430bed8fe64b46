"""Supervising one shard: start its engine, probe it until ready, restart it, stop it.

`Shard` holds the shard's state and the order of its stages; each stage is a module of its
own: `start.py` (what to run, and running it), `probe.py` (the engine asked over HTTP),
`adopt.py` (an engine an earlier agent started), `stop.py` (its process group stopped).

Each engine runs in its own session and process group with its output in a log file, so it
does not depend on the agent staying alive: an agent killed with -9 leaves its engines serving,
and the next run of the agent adopts them from the records it keeps (`Shard.record`). A failure
report carries the last lines of the engine's log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from modelfleet.agent import start
from modelfleet.agent.adapters import AdapterSync, EngineAt
from modelfleet.agent.adopt import EngineProcess, still_running
from modelfleet.agent.logs import LogMarks, last_error_line, rotate, shard_log
from modelfleet.agent.metrics import AgentMetrics
from modelfleet.agent.probe import EngineHttp
from modelfleet.agent.records import EngineRecord
from modelfleet.agent.settings import SupervisorSettings
from modelfleet.agent.stop import terminate
from modelfleet.engines import EngineDriver, NoDriver
from modelfleet.host.processes import ProcessId, free_port, log_tail
from modelfleet.messages.wire import MAX_LOG_TAIL_LINES, ShardAssignment, ShardReport, ShardState

log = logging.getLogger("modelfleet.agent")

ERROR_SEARCH_LINES = 80  # how far back an exited engine's log is searched for its error


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
        metrics: AgentMetrics | None = None,
    ) -> None:
        self.assignment = assignment
        self.driver = driver
        self.settings = settings
        self.log_path = shard_log(log_dir, assignment.replica_id, assignment.rank)
        self.log_marks = LogMarks(self.log_path)  # where its log stood when, for --since
        self._changed = changed
        self._http = http
        self.metrics = metrics or AgentMetrics()
        self.failure_kind = "exited"  # why it last failed (`_fail`)
        self.last_failure = ""  # and in words, kept after a restart
        self.state = ShardState.STARTING
        self.error = ""
        self.port: int | None = None  # where routers reach it
        self.local_port: int | None = None  # behind a gate: the engine's own, on loopback
        self.proc: EngineProcess | None = None
        self.process: ProcessId | None = None  # the engine's identity, for a later adoption
        self.argv: list[str] = []
        self.health_path: str | None = "/health"
        self.started_at = 0.0  # wall clock, for the record
        self.restarts = 0
        self.failures = 0  # in a row, since the engine was last healthy long enough
        self.backoff_s: float | None = None  # while failed: the wait before the next start
        self.startup_s: float | None = None
        self.ready_at: float | None = None  # wall clock: when this engine process was first ready
        self.engine_key: str | None = None  # the key this engine process was started with
        self.probes = 0  # health probes its engine answered, for those who wait on them
        self.adopted = False
        # Shard 0 of a replica of several shards picks where its peers meet it, once, so a
        # restart of it keeps the address its peers were given.
        self.dist_port: int | None = None
        if assignment.num_shards > 1 and assignment.rank == 0:
            self.dist_port = free_port(settings.engine_host, "engines")
        self.task: asyncio.Task[None] | None = None
        self._sleeper: asyncio.Task[None] | None = None  # putting it to sleep or waking it
        # A model with LoRA adapters: shard 0's engine (the one serving HTTP) loads them.
        api = getattr(driver, "adapter_api", None)
        self.adapters: AdapterSync | None = None
        if api is not None and assignment.max_loras is not None and assignment.rank == 0:
            self.adapters = AdapterSync(
                api, self._serving_at, http, changed, assignment.key, assignment.max_loras
            )
            self.adapters.want(dict(assignment.adapters))
        self._adapter_task: asyncio.Task[None] | None = None

    # -- what is reported and recorded ---------------------------------------------------

    def report(self) -> ShardReport:
        failed = self.state is ShardState.FAILED
        # The tail of the last failure goes with every report until the engine is ready again,
        # so a crash loop shows its cause also while the next start is under way.
        tail = failed or (self.failures > 0 and self.state is ShardState.STARTING)
        return ShardReport.of(
            self.assignment,
            self.state,
            port=self.port,
            tls=self.local_port is not None,
            dist_port=self.dist_port,
            pid=self.proc.pid if self.proc else None,
            restarts=self.restarts,
            failures=self.failures,
            backoff_s=self.backoff_s if failed else None,
            startup_s=self.startup_s,
            error=self.error,
            last_failure=self.last_failure,
            log_tail=log_tail(self._failed_run_log(), MAX_LOG_TAIL_LINES) if tail else [],
            engine_key=self.engine_key,
            adapters=self.adapters.report() if self.adapters else [],
        )

    def _failed_run_log(self) -> Path:
        """The log of the run that failed last: the current one while failed; once the next
        run has started (its own log begun, the failed run's moved aside), the one before."""
        if self.state is ShardState.FAILED:
            return self.log_path
        return self.log_path.with_name(f"{self.log_path.name}.1")

    def record(self) -> EngineRecord:
        """What the agent's state dir keeps of this shard: enough for a later run of the agent
        to find its engine again and take it over."""
        return EngineRecord(
            assignment=self.assignment,
            pid=self.process.pid if self.process else None,
            process_started=self.process.started if self.process else None,
            port=self.port,
            local_port=self.local_port,
            dist_port=self.dist_port,
            argv=self.argv,
            health_path=self.health_path,
            started_at=self.started_at,
            ready_at=self.ready_at,
            engine_key=self.engine_key,
            restarts=self.restarts,
            state=self.state,
        )

    def adopt(self, record: EngineRecord) -> bool:
        """Take over the engine `record` describes, if that very process still runs."""
        adopted = still_running(record)
        if adopted is None:
            return False
        process = adopted.process
        self.proc = adopted
        self.process = process
        self.port = record.port
        self.local_port = record.local_port
        self.dist_port = record.dist_port or self.dist_port
        self.argv = list(record.argv)
        self.health_path = record.health_path
        self.started_at = record.started_at or time.time()
        self.ready_at = record.ready_at
        self.engine_key = record.engine_key
        self.restarts = record.restarts
        self.adopted = True
        return True

    async def check_adopted(self) -> None:
        """Probe an adopted engine once, so that one that answers is reported ready (or
        sleeping) from the agent's first report, and no router drops it meanwhile."""
        if self.health_path is None or await self._probe(self.health_path):
            asleep = self.assignment.sleep_mode and await self._engine().sleeping()
            self._set(ShardState.SLEEPING if asleep else ShardState.READY)
            self._settle_sleep()

    def take(self, assignment: ShardAssignment) -> None:
        """`assignment` is for the same engine (digest and generation) as the one held: take
        it, and put the engine to sleep or wake it, load or unload adapters, as it says."""
        held, self.assignment = self.assignment, assignment
        if (assignment.asleep, assignment.sleep_level) != (held.asleep, held.sleep_level):
            self._settle_sleep()
        if self.adapters is not None and assignment.adapters != held.adapters:
            self.adapters.want(dict(assignment.adapters))

    def _serving_at(self) -> EngineAt | None:
        """Where the engine answers while it serves (ready and awake); None otherwise."""
        if self.state is not ShardState.READY or self.port is None:
            return None
        headers = {"authorization": f"Bearer {self.engine_key}"} if self.engine_key else {}
        return EngineAt(self.local_url, headers)

    # -- sleep mode (`idle_action: sleep`) -------------------------------------------------

    def _settle_sleep(self) -> None:
        """Make the engine sleep or wake as its assignment says, in a task of its own (once
        it is up: an engine starting is put to sleep once ready)."""
        if self._sleeper is None or self._sleeper.done():
            self._sleeper = asyncio.ensure_future(self._sleep_or_wake())

    async def _sleep_or_wake(self) -> None:
        failures = 0
        while self.state in (ShardState.READY, ShardState.SLEEPING):
            want = self.assignment.asleep
            if want == (self.state is ShardState.SLEEPING):
                return
            path = f"/sleep?level={self.assignment.sleep_level}" if want else "/wake_up"
            began = time.monotonic()
            error = await self._engine().post(path, self.assignment.startup_timeout)
            if error is None:
                took = time.monotonic() - began
                what = "asleep" if want else "awake"
                log.info("shard %s: %s after %.2fs", self.assignment.key, what, took)
                self._set(ShardState.SLEEPING if want else ShardState.READY)
                continue
            failures += 1
            wait = min(30.0, 0.5 * 2**failures)
            log.warning("shard %s: POST %s failed (%s); again in %.0fs", self.assignment.key,
                        path, error, wait)  # fmt: skip
            await asyncio.sleep(wait)

    def _engine(self) -> EngineHttp:
        return EngineHttp(self._http, self.local_url, self.engine_key)

    @property
    def local_url(self) -> str:
        """Where this agent reaches its engine: on loopback behind a gate, else where it
        listens."""
        if self.local_port is not None:
            return f"http://127.0.0.1:{self.local_port}"
        return f"http://{self.settings.engine_host}:{self.port}"

    @property
    def leader(self) -> str | None:
        """Where this replica's shard 0 meets its peers; None for a replica of one shard."""
        if self.dist_port is not None:
            return f"{self.settings.engine_host}:{self.dist_port}"
        return self.assignment.leader

    def _fail(self, kind: str, error: str) -> None:
        """The engine failed: `kind` (one of `metrics.FAILURE_REASONS`), and why."""
        self.failure_kind = kind
        self.last_failure = f"{kind}: {error}"[:1000]
        self.metrics.failures.labels(kind).inc()
        self._set(ShardState.FAILED, error)

    def _set(self, state: ShardState, error: str = "") -> None:
        if (state, error) != (self.state, self.error):
            self.state, self.error = state, error
            if self.adapters is not None:
                self.adapters.kick()
            self._changed()

    # -- supervision ---------------------------------------------------------------------

    async def supervise(self) -> None:
        """Run the engine (or watch the adopted one), and restart it after a backoff when it
        fails, until cancelled. Whatever goes wrong here, the engine's start included, fails
        the shard with the reason shown, and is retried after the backoff like a crash. A
        shard of a replica of several is not restarted: it stays failed until the control
        plane restarts all of them together (a new generation)."""
        backoff = self.settings.backoff
        if self.adapters is not None and self._adapter_task is None:
            self._adapter_task = asyncio.ensure_future(self.adapters.run())
        while True:
            try:
                if self.adopted:
                    self.adopted = False
                    ready_since = await self._watch()
                else:
                    ready_since = await self._watch() if self._spawn() else None
            except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
                raise
            except Exception as exc:
                log.exception("shard %s: supervision failed", self.assignment.key)
                self._fail("supervision", f"supervision failed: {type(exc).__name__}: {exc}")
                ready_since = None
            ready_for = time.monotonic() - ready_since if ready_since is not None else 0.0
            self.failures = backoff.failures(self.failures, ready_for)
            if self.assignment.num_shards > 1:
                # One shard of several is never restarted alone: its peers would wait on a
                # rendezvous that is gone. The control plane restarts them all together.
                log.warning(
                    "shard %s failed (%s); the control plane restarts its replica's shards "
                    "together",
                    self.assignment.key,
                    self.error,
                )
                self._changed()
                return
            # Like kubelet: an engine that served and crashed once is started again at once;
            # only a crash loop (or an engine that never got ready) waits.
            served_then_failed = ready_since is not None and self.failures == 1
            self.backoff_s = 0.0 if served_then_failed else backoff.delay(self.failures)
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
            self.metrics.restarts.labels(self.failure_kind).inc()
            self.backoff_s = None
            self._set(ShardState.STARTING)

    def _spawn(self) -> bool:
        """Start the engine; False (with the shard failed and why) when it cannot start."""
        settings = self.settings
        try:
            launched = start.launch(self.assignment, self.driver, settings, self.leader)
            rotate(self.log_path)  # the run before's output is kept for `ctl logs --previous`
            self.log_marks.restart()
            extra = start.distributed_env(self.assignment, settings.engine_host)
            proc = start.spawn(launched, self.log_path, extra, settings.pass_env)
        except start.CannotStart as exc:
            self._fail("cannot-start", str(exc))
            return False
        self.port, self.local_port = launched.port, launched.local_port
        self.health_path = launched.launch.health_path
        self.argv = launched.launch.argv
        self.proc = proc
        self.engine_key = launched.key
        if self.adapters is not None:
            self.adapters.restarted()  # a new engine holds none of them
        self.process = ProcessId.of(proc.pid)
        self.started_at = time.time()
        self.ready_at = None
        self.startup_s = None
        self._changed()
        log.info("shard %s: started pid %d on port %d", self.assignment.key, proc.pid, self.port)
        return True

    async def _watch(self) -> float | None:
        """Probe the running engine until it is ready, then watch it until it exits or stops
        answering; return when it became ready (monotonic), or None when it never did.

        An engine not ready within its startup timeout is stopped: "startup timed out". Once
        an engine process has been ready (also before this agent adopted it) the startup
        timeout no longer applies to it; instead `liveness_failures` failed probes in a row
        make it unready and it is stopped, to be started again.
        """
        proc = self.proc
        assert proc is not None
        s = self.settings
        timeout = self.assignment.startup_timeout
        began = time.monotonic() - max(0.0, time.time() - self.started_at)
        deadline = began + timeout
        up = (ShardState.READY, ShardState.SLEEPING)
        ready_since = time.monotonic() if self.state in up else None
        next_probe = time.monotonic() + s.liveness_interval
        misses = 0
        while True:
            self.log_marks.note(time.time())
            code = proc.poll()
            if code is not None:
                how = "code unknown: an earlier agent run started it" if code == -1 else code
                said = last_error_line(log_tail(self.log_path, ERROR_SEARCH_LINES))
                self._fail("exited", f"engine exited ({how})" + (f": {said}" if said else ""))
                await self._terminate()  # what it started may outlive it: its workers
                return ready_since
            now = time.monotonic()
            if self.ready_at is None:  # starting: probe until ready, within the timeout
                if now > deadline:
                    await self._terminate()
                    self._fail("startup-timeout", f"startup timed out after {timeout:.0f}s")
                    return None
                if self.health_path is None or await self._probe(self.health_path):
                    ready_since = time.monotonic()
                    self.ready_at = time.time()
                    self.startup_s = round(ready_since - began, 3)
                    self.metrics.start_seconds.observe(self.startup_s)
                    self._set(ShardState.READY)
                    if self.assignment.asleep:  # started while it should sleep
                        self._settle_sleep()
                    next_probe = ready_since + s.liveness_interval
                await asyncio.sleep(s.probe_interval if self.ready_at is None else s.watch_interval)
                continue
            if self.health_path is not None and now >= next_probe:
                if await self._probe(self.health_path, s.liveness_timeout):
                    misses = 0
                    if ready_since is None:  # adopted unready: ready again
                        ready_since = time.monotonic()
                        self._set(ShardState.READY)
                else:
                    misses += 1
                    self.metrics.probe_failures.inc()
                    if misses >= s.liveness_failures:
                        self._fail(
                            "unhealthy",
                            f"health check failed {misses} times in a row; restarting the engine",
                        )
                        await self._terminate()
                        return ready_since
                next_probe = time.monotonic() + (
                    s.liveness_interval if misses == 0 else s.probe_interval
                )
            await asyncio.sleep(s.watch_interval)

    async def _probe(self, path: str, timeout: float = 2.0) -> bool:
        if await self._engine().healthy(path, timeout):
            self.probes += 1
            return True
        return False

    async def _terminate(self) -> None:
        if self.proc is not None:
            await terminate(self.proc, self.settings.stop_grace, self.assignment.key)

    async def stop(self) -> None:
        """Stop supervising and stop the engine (it finishes in-flight requests first)."""
        self._set(ShardState.STOPPING)
        for task in (self.task, self._sleeper, self._adapter_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self._terminate()
