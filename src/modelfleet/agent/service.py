"""The agent: one per GPU machine. Reports its node, runs the shards it is assigned.

Level-triggered: at once after a change, the agent sends its whole state (GPUs and shards) and
gets back the node's whole desired shard set, which it makes true: it starts what is missing
and stops what is no longer assigned. While nothing changes it sends heartbeats, which the
control plane holds until the node's assignment changes or the heartbeat interval (set by the
control plane) is up (`controlplane/agent_api.py`). The agent records
each engine it started in its state dir (`agent/records.py`), for a later run to adopt.

Given several control planes, it talks to one: a follower redirects it (307) to the leader,
and it goes on to the next when its own stops answering, keeping its engines meanwhile. Every
answer carries the leader's lease epoch; an answer of an epoch lower than one the agent has
seen comes from a leader that lost its lease without knowing yet, and is refused.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import secrets
import time
from collections.abc import Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelfleet.agent.gpus import BadGpuSpec, GpuSource, SimulatedGpus
from modelfleet.agent.heartbeat import needs_report, retry_delay
from modelfleet.agent.logs import read_log, shard_log
from modelfleet.agent.metrics import AgentMetrics
from modelfleet.agent.records import read_records, write_records
from modelfleet.agent.settings import AgentSettings
from modelfleet.agent.supervisor import Shard
from modelfleet.agent.uplink import Beat, Uplink
from modelfleet.agent.use import USE_EVERY_S, EngineOn, SimulatedUse, read_busy_seconds
from modelfleet.core.nesting import check_json
from modelfleet.engines import EngineDriver, NoDriver, driver_for
from modelfleet.host.clock import wait_set
from modelfleet.host.files import write_json_atomic
from modelfleet.host.processes import stop_leftovers
from modelfleet.http.engine_metrics import translate
from modelfleet.http.serving import Listener, run_service
from modelfleet.http.web import bearer_matches, error_response, json_response
from modelfleet.messages.wire import (
    AgentReport,
    HeartbeatAnswer,
    LogRequest,
    NodeAssignment,
    NodeUse,
    ShardAssignment,
    ShardState,
)

log = logging.getLogger("modelfleet.agent")


class Agent:
    """The agent's state: its shards, and the connection to the control plane.

    Use it as an async context manager: inside, every shard's supervision and every engine
    being stopped runs as a task of the agent's task group; leaving it cancels them (the
    engines keep running, to be adopted by the next run) and records what runs.
    """

    def __init__(self, settings: AgentSettings, gpus: GpuSource) -> None:
        self.settings = settings
        self.gpu_source = gpus
        self.shards: dict[str, Shard] = {}
        self.stopping: dict[str, Shard] = {}
        self.seq = 0
        self.boot_id = secrets.token_hex(8)
        self._changed = asyncio.Event()
        self.link = Uplink(settings, self.boot_id, self._changed)
        self._probe = httpx.AsyncClient()
        if isinstance(gpus, SimulatedGpus):
            gpus.holding = lambda: [
                (s.assignment.gpus, s.state)
                for s in (*self.shards.values(), *self.stopping.values())
            ]
        self.metrics = AgentMetrics()
        self.metrics.watch(
            lambda: [s.state for s in (*self.shards.values(), *self.stopping.values())],
            self.gpu_source.gpus,
        )
        self._group = asyncio.TaskGroup()
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Agent:
        await self._group.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop supervising (the engines keep running: they outlive the agent), record them."""
        for task in list(self._tasks):
            task.cancel()
        try:
            await self._group.__aexit__(exc_type, exc, tb)
        finally:
            self._record()
            await self.link.aclose()
            await self._probe.aclose()

    def _run(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = self._group.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def changed(self) -> None:
        self._changed.set()
        self._record()

    async def _pause(self, seconds: float) -> None:
        """Wait `seconds`, or less if something changes."""
        await wait_set(self._changed, seconds)

    async def _pause_after_failure(self) -> None:
        """Wait about `report_interval` (spread: `retry_delay`) before trying again."""
        await self._pause(retry_delay(self.settings.report_interval, random.random()))

    def report(self) -> AgentReport:
        self.seq += 1
        shards = [s.report() for s in (*self.shards.values(), *self.stopping.values())]
        return AgentReport(
            node=self.settings.node,
            boot_id=self.boot_id,
            seq=self.seq,
            address=self.settings.address,
            labels=dict(self.settings.labels),
            gpus=self.gpu_source.gpus(),
            shards=shards,
        )

    def apply(self, assignment: NodeAssignment) -> None:
        """Make the node's shards match `assignment`: start the missing, stop the extra."""
        wanted: dict[str, ShardAssignment] = {a.key: a for a in assignment.shards}
        for key, shard in list(self.shards.items()):
            # Same shard, same engine, same generation: keep it running, whatever else the
            # answer says. A shard of another generation is stopped, and the new one started
            # once it has (its key is free again).
            want = wanted.get(key)
            held = shard.assignment
            if want is None or (want.engine_digest, want.generation) != (
                held.engine_digest,
                held.generation,
            ):
                self._stop(key)
            elif want != held:
                shard.take(want)
        for key, a in wanted.items():
            if key in self.shards or key in self.stopping:
                continue
            if a.num_shards > 1 and a.rank > 0 and a.leader is None:
                continue  # started once shard 0 has said where it meets its peers
            self._start(a)

    def _shard(self, assignment: ShardAssignment) -> Shard:
        driver: EngineDriver | NoDriver
        try:
            driver = driver_for(assignment.engine)
        except NoDriver as exc:
            driver = exc  # the shard reports the error as its failure
        return Shard(
            assignment,
            driver,
            self.settings.state_dir / "logs",
            self.settings.supervisor,
            self.changed,
            self._probe,
            self.metrics,
        )

    def _supervise(self, key: str, shard: Shard) -> None:
        self.shards[key] = shard
        shard.task = self._run(shard.supervise(), f"shard {key}")

    def _start(self, assignment: ShardAssignment) -> None:
        self._supervise(assignment.key, self._shard(assignment))
        self.changed()

    async def adopt(self) -> list[str]:
        """Take over the engines an earlier run of this agent started and that still run.

        They are supervised as if this run had started them: probed, restarted when they fail,
        stopped when the control plane no longer assigns them. Each is probed once before this
        returns, so one that answers is reported ready from the first report. An engine whose
        process is gone is forgotten. Returns the keys of the shards adopted.
        """
        adopted = []
        for key, record in read_records(self.settings.state_dir).items():
            shard = self._shard(record.assignment)
            if not shard.adopt(record):
                log.info("shard %s: its engine (pid %s) is gone", key, record.pid)
                if record.pid is not None:  # its workers may not be
                    await asyncio.to_thread(
                        stop_leftovers, record.pid, self.settings.supervisor.stop_grace
                    )
                continue
            await shard.check_adopted()
            self._supervise(key, shard)
            adopted.append(key)
            log.info(
                "shard %s: adopted its running engine, pid %s (%s)",
                key,
                record.pid,
                shard.state.value,
            )
        self.changed()
        return adopted

    def _stop(self, key: str) -> None:
        shard = self.shards.pop(key)
        self.stopping[key] = shard
        log.info("shard %s: no longer assigned; stopping", key)

        async def stop() -> None:
            try:
                await shard.stop()
            except Exception:
                log.exception("shard %s: stopping its engine failed", key)
            self.stopping.pop(key, None)
            self.changed()

        self._run(stop(), f"stop {key}")

    def _record(self) -> None:
        """Write what this agent runs to its state dir, for a later run to adopt (and `up`)."""
        records = {key: s.record() for key, s in (*self.shards.items(), *self.stopping.items())}
        write_records(self.settings.state_dir, records)

    async def engine_metrics(self) -> bytes:
        """What this node's engines say of themselves, under `modelfleet_engine_*` names
        (`engine_metrics.py`): each ready shard 0's `/metrics`, read now (one that does not
        answer within a second is left out of this scrape)."""

        async def page(shard: Shard) -> tuple[dict[str, str], str] | None:
            a = shard.assignment
            text = await self._engine_page(shard)
            if text is None:
                return None
            labels = {"model": a.model, "replica": a.replica_id, "node": self.settings.node}
            return labels, text

        serving = [s for s in self.shards.values() if s.assignment.rank == 0]
        pages = await asyncio.gather(*map(page, serving))
        return await asyncio.to_thread(translate, [p for p in pages if p is not None])

    async def _engine_page(self, shard: Shard) -> str | None:
        """A ready engine's `/metrics`, read now; None when it does not answer within a
        second (or is not ready)."""
        if shard.state is not ShardState.READY or shard.port is None:
            return None
        headers = {"authorization": f"Bearer {shard.engine_key}"} if shard.engine_key else {}
        try:
            answer = await self._probe.get(
                shard.local_url + "/metrics", headers=headers, timeout=1.0
            )
        except httpx.HTTPError:
            return None
        return answer.text if answer.status_code == 200 else None

    async def watch_use(self, gpus: SimulatedGpus) -> None:
        """Tell simulated GPUs how busy their engines keep them (`agent/use.py`), every
        USE_EVERY_S, until cancelled."""
        use = SimulatedUse()
        while True:
            shards = [*self.shards.values(), *self.stopping.values()]
            pages = await asyncio.gather(*map(self._engine_page, shards))
            engines = [
                EngineOn(
                    s.assignment.key,
                    tuple(s.assignment.gpus),
                    read_busy_seconds(page) if page is not None else None,
                )
                for s, page in zip(shards, pages, strict=True)
            ]
            indices = [g.index for g in gpus.gpus()]
            for index, busy in use.sample(engines, indices, time.monotonic()).items():
                gpus.set_utilization(index, busy)
            await asyncio.sleep(USE_EVERY_S)

    async def send_logs(self, requests: list[LogRequest]) -> None:
        """Read what the control plane asked of engines' logs, and send it (`ctl logs`)."""
        folder = self.settings.state_dir / "logs"
        for request in requests:
            path = shard_log(folder, request.replica_id, request.rank)
            answer = await asyncio.to_thread(read_log, path, request, time.time())
            await self.link.send_log(answer)

    async def report_loop(self, ready_file: Path | None, urls: dict[str, str]) -> None:
        """Adopt what an earlier run left running; then report (or beat while nothing
        changed), apply the answer, repeat. The ready file is written after the first answer.
        """
        await self.adopt()
        if isinstance(self.gpu_source, SimulatedGpus):
            self._run(self.watch_use(self.gpu_source), "gpu use")
        ready_written = False
        taken: AgentReport | None = None  # the last report the control plane took
        held: NodeAssignment | None = None  # the assignment it answered with, last made true
        while True:
            self._changed.clear()
            report = self.report()
            if held is None or needs_report(taken, report):
                assignment = await self.link.send_report(report)
                if assignment is None:
                    taken = None
                    await self._pause_after_failure()
                    continue
                taken = report
                if assignment.log_requests:
                    self._run(self.send_logs(assignment.log_requests), "logs")
            else:
                answer = await self.link.send_heartbeat(
                    report.seq, held, NodeUse.of(self.gpu_source.gpus())
                )
                if answer is Beat.CHANGED:
                    continue
                if not isinstance(answer, HeartbeatAnswer):
                    taken = None
                    if answer is Beat.FAILED:
                        await self._pause_after_failure()
                    continue
                if answer.log_requests:
                    self._run(self.send_logs(answer.log_requests), "logs")
                assignment = answer.assignment or held.model_copy(
                    update={"heartbeat_interval": answer.heartbeat_interval, "epoch": answer.epoch}
                )
            if held is None or held.version != assignment.version:
                log.info(
                    "assignment %s of epoch %d from %s: %d shard(s)",
                    assignment.version,
                    assignment.epoch,
                    self.link.control_plane,
                    len(assignment.shards),
                )
            held = assignment
            self.apply(assignment)
            if not ready_written and ready_file is not None:
                ready = {"pid": os.getpid(), "node": self.settings.node, "urls": urls}
                write_json_atomic(ready_file, ready)
                ready_written = True


def create_admin_app(agent: Agent) -> Starlette:
    """The agent's own small admin API (the agent's token: the node's credential once joined,
    else the fleet's shared agent token): simulated GPU faults at run time.

    `GET /v1/gpus` lists the GPUs as reported; `PUT /v1/gpus/{index}/health` with
    `{"healthy": false, "reason": "XID 79"}` makes a simulated GPU fail (or recover).
    `GET /metrics`: the agent's Prometheus metrics (`agent/metrics.py`).
    """

    def authorized(request: Request) -> bool:
        token = agent.link.settings.token
        return token is None or bearer_matches(request.headers.get("authorization"), token)

    async def metrics(request: Request) -> Response:
        if not authorized(request):
            return error_response(401, "missing or wrong agent token")
        body = generate_latest(agent.metrics.registry) + await agent.engine_metrics()
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def list_gpus(request: Request) -> Response:
        if not authorized(request):
            return error_response(401, "missing or wrong agent token")
        return json_response({"gpus": [g.model_dump() for g in agent.gpu_source.gpus()]})

    async def set_health(request: Request) -> Response:
        if not authorized(request):
            return error_response(401, "missing or wrong agent token")
        if not isinstance(agent.gpu_source, SimulatedGpus):
            return error_response(409, "only simulated GPUs can be made (un)healthy")
        try:
            raw = await request.body()
            check_json(raw)  # TooDeep is a ValueError: refused below (deep JSON was a 500)
            body = json.loads(raw)
            healthy = body["healthy"]
            if not isinstance(healthy, bool):
                raise TypeError("'healthy' must be true or false")
            gpu = agent.gpu_source.set_health(
                int(request.path_params["index"]), healthy, str(body.get("reason", ""))
            )
        except BadGpuSpec as exc:
            return error_response(404, str(exc))
        except (ValueError, KeyError, TypeError) as exc:
            message = f'send {{"healthy": true|false, "reason": "..."}}: {exc}'
            return error_response(400, message)
        log.warning("gpu %d made %s by the admin API", gpu.index, gpu.reason or "healthy")
        agent.changed()
        return json_response(gpu.model_dump())

    return Starlette(
        routes=[
            Route("/metrics", metrics),
            Route("/v1/gpus", list_gpus),
            Route("/v1/gpus/{index:int}/health", set_health, methods=["PUT"]),
        ]
    )


async def serve(
    settings: AgentSettings,
    gpus: GpuSource,
    ready_file: Path | None,
    admin_port: int | None = None,
) -> None:
    """Run an agent until SIGINT/SIGTERM. Its engines keep running after it exits.

    With `admin_port` it also serves its admin API there (0 picks a free port).
    """
    async with Agent(settings, gpus) as agent:
        listeners = []
        if admin_port is not None:
            app = create_admin_app(agent)
            admin = Listener("admin", app, settings.address, admin_port, tls=settings.admin_tls)
            listeners.append(admin)

        async def loop() -> None:
            await agent.report_loop(ready_file, {li.name: li.url for li in listeners})

        await run_service(listeners, loops=[loop])
