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
import dataclasses
import enum
import json
import logging
import os
import random
import secrets
import ssl
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelfleet.agent.credential import JoinFailed, Unreachable, join
from modelfleet.agent.gpus import BadGpuSpec, GpuSource, SimulatedGpus
from modelfleet.agent.heartbeat import needs_report, retry_delay
from modelfleet.agent.logs import read_log, shard_log
from modelfleet.agent.metrics import AgentMetrics
from modelfleet.agent.records import read_records, write_records
from modelfleet.agent.settings import SupervisorSettings
from modelfleet.agent.supervisor import Shard
from modelfleet.agent.use import USE_EVERY_S, EngineOn, SimulatedUse, read_busy_seconds
from modelfleet.engines import EngineDriver, NoDriver, driver_for
from modelfleet.host.clock import wait_set
from modelfleet.host.files import write_json_atomic
from modelfleet.host.processes import stop_leftovers
from modelfleet.http.engine_metrics import translate
from modelfleet.http.serving import Listener, run_service
from modelfleet.http.web import bearer_matches, error_response, json_response
from modelfleet.messages.wire import (
    AgentReport,
    Heartbeat,
    HeartbeatAnswer,
    LogRequest,
    NodeAssignment,
    NodeUse,
    ShardAssignment,
    ShardState,
)
from modelfleet.security.joining import BadJoinToken, JoinToken
from modelfleet.security.pki import PkiError, TlsFiles

log = logging.getLogger("modelfleet.agent")

# With several control planes, one that does not answer in time is left for the next: it may be
# frozen, or cut off, and a new leader takes its lease within the lease's TTL (3 s by default).
# With one, there is nowhere else to go: it is given the time a busy one may need (a restart at
# 10,000 nodes answers thousands of reports at once).
PATIENCE_S = {"one": (10.0, 10.0), "several": (1.0, 3.0)}  # to connect, to answer
# How much longer than the interval the control plane holds a heartbeat it is waited for.
HOLD_MARGIN_S = {"one": 10.0, "several": 1.0}
REFUSED_WAIT_MAX_S = 60.0  # the longest wait between tries while the control plane refuses it


@dataclass(frozen=True)
class AgentSettings:
    control_plane: str
    node: str
    token: str | None
    state_dir: Path
    # Checks the control plane's certificate (`pki.client_context`); None: the system's CAs.
    verify: ssl.SSLContext | None = None
    admin_tls: TlsFiles | None = None  # the admin listener's certificate, once joined
    address: str = "127.0.0.1"
    labels: tuple[tuple[str, str], ...] = ()
    report_interval: float = 2.0
    supervisor: SupervisorSettings = field(default_factory=SupervisorSettings)
    # Every control plane of the fleet, `control_plane` first, when several share a store:
    # the agent reports to one, follows a follower's redirect to the leader, and goes to the
    # next when it fails.
    control_planes: tuple[str, ...] = ()
    # How it reaches the control plane; None: the network (tests pass httpx.MockTransport).
    transport: httpx.AsyncBaseTransport | None = None
    # The join token the agent was given (`--join`): once the control plane refuses the kept
    # credential (the node revoked, and re-added), the agent joins anew with it.
    join_token: str | None = field(default=None, repr=False)


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
        headers = {"authorization": f"Bearer {settings.token}"} if settings.token else {}
        self._urls = settings.control_planes or (settings.control_plane,)
        self._at = 0  # the control plane it talks to now, in `_urls`
        self.epoch = 0  # the highest lease epoch of a leader it has taken an answer from
        self._how_many = "several" if len(self._urls) > 1 else "one"
        self._cp = httpx.AsyncClient(
            base_url=settings.control_plane,
            headers=headers,
            timeout=httpx.Timeout(
                PATIENCE_S[self._how_many][1], connect=PATIENCE_S[self._how_many][0]
            ),
            verify=settings.verify if settings.verify is not None else True,
            transport=settings.transport,
        )
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
        self._refusal: str | None = None  # why the control plane refuses this agent, as said
        self._refusals = 0  # refusals in a row: each waits longer
        self._tokens_tried: set[str] = set()

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
            await self._cp.aclose()
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

    @property
    def control_plane(self) -> str:
        """The control plane this agent talks to now."""
        return self._urls[self._at]

    def _next_control_plane(self) -> None:
        """The one it talks to failed, or follows another: try the next (a new one asks for
        the whole report, by its answer to a heartbeat)."""
        if len(self._urls) < 2:
            return
        self._at = (self._at + 1) % len(self._urls)
        self._cp.base_url = httpx.URL(self._urls[self._at])
        log.info("talking to the control plane at %s now", self._urls[self._at])

    def _follow(self, response: httpx.Response) -> bool:
        """A follower's 307 names the leader: talk to it from now on. False when the answer
        names no location."""
        location = response.headers.get("location")
        if not location:
            return False
        target = httpx.URL(location)
        base = str(target.copy_with(path="/", query=None, fragment=None)).rstrip("/")
        if base not in self._urls:  # a leader not on the command line: kept, after them
            self._urls = (*self._urls, base)
        self._at = self._urls.index(base)
        self._cp.base_url = httpx.URL(base)
        log.info("%s follows; talking to the leader at %s now", response.url.host, base)
        return True

    def took_epoch(self, epoch: int) -> bool:
        """Whether an answer of a leader under lease `epoch` may be taken: not when the agent
        has seen a newer leader (this one lost its lease and does not know yet)."""
        if epoch < self.epoch:
            log.warning(
                "refused an assignment of epoch %d from %s: a leader of epoch %d has answered "
                "before",
                epoch,
                self.control_plane,
                self.epoch,
            )
            self._next_control_plane()
            return False
        if epoch > self.epoch:
            log.info("the leader at %s answers under epoch %d", self.control_plane, epoch)
            self.epoch = epoch
        return True

    async def send_report(self, report: AgentReport) -> NodeAssignment | None:
        """One exchange with the control plane; None when it failed (logged, retried later).
        Sent again at once to the leader a follower names."""
        for _ in range(len(self._urls) + 1):
            try:
                response = await self._cp.post("/v1/report", content=report.model_dump_json())
            except httpx.HTTPError as exc:
                log.warning("report to %s failed: %s", self.control_plane, describe(exc))
                self._next_control_plane()
                return None
            if response.status_code != 307 or not self._follow(response):
                break
        if response.status_code == 401:
            await self._refused(response)
            return None
        if response.status_code != 200:
            log.warning("control plane refused report %d: %s", report.seq, response.text[:300])
            if response.status_code == 503:
                self._next_control_plane()
            return None
        self._accepted()
        try:
            assignment = NodeAssignment.model_validate_json(response.content)
        except ValidationError as exc:
            log.warning("control plane answered with no assignment: %s", exc)
            return None
        return assignment if self.took_epoch(assignment.epoch) else None

    async def _refused(self, response: httpx.Response) -> None:
        """The control plane refuses this agent's token or credential (401): say so once,
        clearly; join anew when a join token was given that was not tried yet; and wait
        longer after each refusal in a row (up to REFUSED_WAIT_MAX_S), so that a revoked node
        neither floods its log nor the control plane."""
        why = _error_of(response)
        if why != self._refusal:
            log.error(
                "the control plane at %s refuses this agent: %s. Nothing it sends is taken; "
                "its engines keep running.",
                self.control_plane,
                why,
            )
            self._refusal = why
        token = self.settings.join_token
        if token is not None and token not in self._tokens_tried:
            self._tokens_tried.add(token)
            if await self._join_anew(token):
                return
        self._refusals += 1
        wait = min(REFUSED_WAIT_MAX_S, self.settings.report_interval * 2**self._refusals)
        await self._pause(wait)

    async def _join_anew(self, token: str) -> bool:
        """Join again with `token`, taking the new credential; whether it joined."""
        s = self.settings
        try:
            parsed = JoinToken.parse(token)
            joined = await asyncio.to_thread(
                join, s.control_plane, parsed, s.node, [s.address], s.state_dir
            )
        except (BadJoinToken, JoinFailed, Unreachable, PkiError, OSError) as exc:
            log.error("cannot join anew with the join token given: %s", exc)
            return False
        joined.tls_files(s.state_dir)  # new certificates: the engines started from now use them
        joined.ca_file(s.state_dir)
        self.settings = dataclasses.replace(s, token=joined.credential)
        self._cp.headers["authorization"] = f"Bearer {joined.credential}"
        self._refusal, self._refusals = None, 0
        log.info("joined anew as node %s with the join token given", s.node)
        return True

    def _accepted(self) -> None:
        """The control plane takes what this agent sends (again)."""
        if self._refusal is not None:
            log.info("the control plane at %s takes this agent's reports again",
                     self.control_plane)  # fmt: skip
        self._refusal, self._refusals = None, 0

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
            try:
                await self._cp.post("/v1/logs", content=answer.model_dump_json())
            except httpx.HTTPError as exc:
                log.warning("log answer to %s failed: %s", self.control_plane, describe(exc))

    async def send_heartbeat(self, seq: int, held: NodeAssignment) -> HeartbeatAnswer | Beat:
        """One heartbeat: its answer, or why there is none. It is given up when something
        changes meanwhile, so that the change is reported at once."""
        beat = Heartbeat(
            node=self.settings.node,
            boot_id=self.boot_id,
            seq=seq,
            assignment=held.version,
            use=NodeUse.of(self.gpu_source.gpus()),
        )
        # The control plane holds the answer up to one interval: wait a little longer.
        connect, within = PATIENCE_S[self._how_many]
        read = held.heartbeat_interval + HOLD_MARGIN_S[self._how_many]
        timeout = httpx.Timeout(within, connect=connect, read=read)
        sent = asyncio.ensure_future(
            self._cp.post("/v1/heartbeat", content=beat.model_dump_json(), timeout=timeout)
        )
        changed = asyncio.ensure_future(self._changed.wait())
        try:
            await asyncio.wait({sent, changed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
            if not sent.done():
                sent.cancel()
        if not sent.done() or sent.cancelled():
            return Beat.CHANGED
        try:
            response = sent.result()
        except httpx.HTTPError as exc:
            log.warning("heartbeat to %s failed: %s", self.control_plane, describe(exc))
            self._next_control_plane()
            return Beat.FAILED
        if response.status_code == 409:  # it holds no report of this run: send one
            log.info("control plane asks for the whole report: %s", response.text[:300])
            return Beat.REPORT
        if response.status_code == 307 and self._follow(response):
            return Beat.REPORT  # to the leader, at once
        if response.status_code == 401:
            await self._refused(response)
            return Beat.REPORT
        if response.status_code != 200:
            log.warning("control plane refused heartbeat %d: %s", seq, response.text[:300])
            if response.status_code == 503:
                self._next_control_plane()
            return Beat.FAILED
        try:
            answer = HeartbeatAnswer.model_validate_json(response.content)
        except ValidationError as exc:
            log.warning("control plane answered a heartbeat with nonsense: %s", exc)
            return Beat.FAILED
        return answer if self.took_epoch(answer.epoch) else Beat.FAILED

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
                assignment = await self.send_report(report)
                if assignment is None:
                    taken = None
                    await self._pause_after_failure()
                    continue
                taken = report
                if assignment.log_requests:
                    self._run(self.send_logs(assignment.log_requests), "logs")
            else:
                answer = await self.send_heartbeat(report.seq, held)
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
                    self.control_plane,
                    len(assignment.shards),
                )
            held = assignment
            self.apply(assignment)
            if not ready_written and ready_file is not None:
                ready = {"pid": os.getpid(), "node": self.settings.node, "urls": urls}
                write_json_atomic(ready_file, ready)
                ready_written = True


class Beat(enum.Enum):
    """Why a heartbeat has no answer."""

    CHANGED = "something changed: report it instead"
    REPORT = "the control plane asks for the whole report"
    FAILED = "it failed: try again after a while"


def create_admin_app(agent: Agent) -> Starlette:
    """The agent's own small admin API (the agent's token: the node's credential once joined,
    else the fleet's shared agent token): simulated GPU faults at run time.

    `GET /v1/gpus` lists the GPUs as reported; `PUT /v1/gpus/{index}/health` with
    `{"healthy": false, "reason": "XID 79"}` makes a simulated GPU fail (or recover).
    `GET /metrics`: the agent's Prometheus metrics (`agent/metrics.py`).
    """

    def authorized(request: Request) -> bool:
        token = agent.settings.token
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
            body = json.loads(await request.body())
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


def _error_of(response: httpx.Response) -> str:
    """The error a control plane's answer carries, or its text."""
    try:
        said = response.json().get("error")
    except (ValueError, AttributeError):
        said = None
    return str(said) if said else response.text.strip()[:300]


def describe(exc: httpx.HTTPError) -> str:
    """Why an exchange failed, never empty: httpx's timeouts carry no message."""
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer in time ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
