"""The control plane at fleet scale, measured end to end on this machine.

A real control plane (`modelfleet control-plane`, its own process) serves simulated agents of
1,000, 5,000 and 10,000 nodes of 8 GPUs, driven over HTTP from this process, with a catalog of
about two replicas per node. Each simulated agent speaks the agent protocol as `agent/service.py`
does, at the defaults: a whole report when its shards change, a heartbeat (held by the control
plane up to the heartbeat interval it sets) otherwise. A simulated router in this process takes
the routing tables the control plane pushes. For each size it prints:

- the control plane's CPU seconds per second of wall time while the fleet is steady (user +
  system from /proc), and its RSS;
- the latency of a whole report, p50 and p99 (reports of unchanged nodes sent at 20/s during the
  steady phase), and the heartbeats answered per second;
- the time from a catalog change adding 1,000 replicas (`PUT /v1/catalog`) until every agent
  concerned holds its assignment;
- the time from a restart of the control plane (SIGTERM, then started on the same state dir)
  until every replica is adopted and the router holds a full table, and how many replicas were
  started or stopped meanwhile (none should be);
- the last reconcile pass with nothing to plan, as the control plane times it (`/v1/status`);
- with `--silence S`, then every agent falls silent for S seconds (the control plane cut off
  from its fleet: its nodes go stale, then lost, and nothing may move): its CPU meanwhile, and
  how long it then takes to stop.

Then the growth ratio of each cost per tenfold of fleet size, and one JSON line with
`cpu_s_per_s` and `report_p99_ms` (by size), `catalog_to_assignments_s_10000`,
`adopt_s_10000`, `restart_churn_10000`, `idle_pass_ms_10000` and `rss_mb_10000`.

    python bench/controlplane_scale.py [--sizes 1000,5000,10000] [--steady 20] [--silence 90]

Targets at 10,000 nodes: at most 0.5 CPU-seconds per second, report p99 within 50 ms, 1,000 new
replicas assigned within 5 s, adoption after a restart within 10 s with no replica started or
stopped (`restart_churn` 0), an idle pass within 10 ms, RSS within 1 GB; every cost growing at
most linearly. Needs about twice 10,000 file descriptors.

Each heartbeat carries its GPUs' memory and utilisation, and the control plane writes the
plots' points (`controlplane/series.py`) every minute, as by default: a point per node and
model, 20,000 rows at 10,000 nodes. SERIES_INTERVAL in the environment sets another (at 10 s
such a write every 10 s took report p99 from 28 to 142 ms on a 2-core machine).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
import yaml
from aiohttp import web
from kit import end_on_sigterm, json_line, waited

from modelfleet.agent.heartbeat import retry_delay
from modelfleet.host.files import write_atomic
from modelfleet.messages.wire import (
    AgentReport,
    GpuReport,
    NodeAssignment,
    ShardReport,
    ShardState,
)
from modelfleet.router.upstream import UpstreamError, Upstreams

GIB = 2**30
GPUS = tuple(
    GpuReport(index=i, model="H100", memory_total=80 * GIB, memory_used=0) for i in range(8)
)
# What each agent's heartbeat carries for the plots: its GPUs' memory and utilisation.
USE = {"memory_used": 8 * 72 * GIB, "memory_total": 8 * 80 * GIB, "utilization": 61.5}
MODELS = 20
SERIES_INTERVAL = int(os.environ.get("SERIES_INTERVAL", "60"))  # the control plane's default
ADDED = 1000
TOKEN = "bench-admin-token"
JSON_HEADERS = (("content-type", "application/json"),)
RETRY_S = 2.0  # the agent's default report_interval: its pause after a failed exchange,
# spread as the agent spreads it


def catalog(nodes: int, added: bool) -> str:
    """About two replicas of 2 GPUs per node (half the GPUs), and with `added` 1,000 more."""
    models = [
        {"name": f"m{i}", "engine": "sim", "replicas": 2 * nodes // MODELS, "gpus_per_shard": 2}
        for i in range(MODELS)
    ]
    if added:
        models.append({"name": "added", "engine": "sim", "replicas": ADDED, "gpus_per_shard": 2})
    return yaml.safe_dump({"models": models})


class Fleet:
    """What the simulated agents and the simulated router have seen, for the phases to wait on."""

    def __init__(self) -> None:
        self.report_ms: list[float] = []
        self.beats = 0  # heartbeats answered while measuring
        self.added_shards = 0  # shards of the model "added" assigned to some node
        self.started = 0  # shards an agent was newly assigned
        self.dropped = 0  # shards an agent was told to stop
        self.errors = 0
        self.beating = 0  # nodes whose last exchange was a heartbeat
        self.table: tuple[int, int] = (0, 0)  # the router's (epoch, endpoints)
        self.measuring = False
        self.lag_ms: list[float] = []  # this process's own event loop lag while measuring

    def seen(self) -> str:
        """The counters, for a wait that timed out."""
        return (
            f"beating {self.beating}, started {self.started}, dropped {self.dropped}, "
            f"errors {self.errors}, table {self.table}"
        )

    async def watch_lag(self) -> None:
        """How late this process's event loop wakes up: when it is late, so are the figures
        it takes, and the bench is measuring itself."""
        while True:
            began = time.perf_counter()
            await asyncio.sleep(0.01)
            if self.measuring:
                self.lag_ms.append((time.perf_counter() - began - 0.01) * 1000)


class SimNode:
    """One simulated agent: its shards report ready as soon as assigned."""

    def __init__(self, index: int, fleet: Fleet, client: Upstreams, url: str):
        self.name = f"node-{index:05d}"
        self.address = f"10.{index // 65536}.{index // 256 % 256}.{index % 256}"
        self.fleet = fleet
        self.client = client
        self.url = url
        self.boot_id = secrets.token_hex(8)
        self.seq = 0
        self.shards: dict[tuple[str, int], ShardReport] = {}
        self.held: NodeAssignment | None = None
        self.taken = False  # whether the control plane took the report of the shards held now
        self._report: str | None = None
        self.beating = False

    def report(self) -> bytes:
        """The node's report, made by pydantic once per change of its shards and given a new
        count each time: the agents are simulated cheaply, so that the figures are the control
        plane's and not this process's (both share this machine's cores)."""
        self.seq += 1
        if self._report is None:
            self._report = AgentReport(
                node=self.name,
                boot_id=self.boot_id,
                seq=0,
                address=self.address,
                gpus=list(GPUS),
                shards=list(self.shards.values()),
            ).model_dump_json()
        return self._report.replace('"seq":0,', f'"seq":{self.seq},', 1).encode()

    def apply(self, assignment: NodeAssignment) -> None:
        wanted = {(a.replica_id, a.rank): a for a in assignment.shards}
        for key in [k for k in self.shards if k not in wanted]:
            del self.shards[key]
            self.fleet.dropped += 1
            self.taken, self._report = False, None
        for port, (key, a) in enumerate(sorted(wanted.items()), start=8000):
            if key not in self.shards:
                self.shards[key] = ShardReport.of(a, ShardState.READY, port=port)
                self.fleet.started += 1
                self.fleet.added_shards += a.model == "added"
                self.taken, self._report = False, None
        self.held = assignment

    def set_beating(self, beating: bool) -> None:
        self.fleet.beating += beating - self.beating
        self.beating = beating

    async def run(self) -> None:
        while True:
            try:
                if self.held is None or not self.taken:
                    self.set_beating(False)
                    await self.send_report()
                else:
                    self.set_beating(True)
                    await self.send_heartbeat(self.held)
            except (UpstreamError, TimeoutError):
                self.fleet.errors += 1
                self.taken = False
                self.set_beating(False)
                await asyncio.sleep(retry_delay(RETRY_S, random.random()))

    async def send_report(self, probe: bool = False) -> None:
        body = self.report()
        began = time.perf_counter()
        status, content = await self.post("/v1/report", body)
        if probe and self.fleet.measuring:
            self.fleet.report_ms.append((time.perf_counter() - began) * 1000)
        if status != 200:
            raise UpstreamError(f"report refused: {status} {content[:200]!r}")
        if not probe:
            self.taken = True
            self.take(json.loads(content))

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """One exchange over the router's own HTTP/1.1 client (`router/upstream.py`): the
        simulated agents cost this process less than with aiohttp (whose connection set-up
        and error paths were most of this process's time across a restart)."""
        answer = await self.client.post(self.url, path, body, JSON_HEADERS)
        try:
            parts = []
            while chunk := await answer.read():
                parts.append(chunk)
        finally:
            answer.release()
        return answer.status, b"".join(parts)

    def take(self, assignment: dict[str, Any]) -> None:
        """Make `assignment` (as JSON) true; validated only when it is another than held."""
        if self.held is not None and assignment["version"] == self.held.version:
            return
        self.apply(NodeAssignment.model_validate(assignment))

    async def send_heartbeat(self, held: NodeAssignment) -> None:
        self.seq += 1
        beat = json.dumps(
            {"node": self.name, "boot_id": self.boot_id, "seq": self.seq,
             "assignment": held.version, "use": USE}
        )  # fmt: skip
        status, content = await self.post("/v1/heartbeat", beat.encode())
        if status == 409:
            self.taken = False
            return
        if status != 200:
            raise UpstreamError(f"heartbeat refused: {status} {content[:200]!r}")
        answer = json.loads(content)
        if answer.get("assignment") is not None:
            self.take(answer["assignment"])
        elif self.fleet.measuring:
            self.fleet.beats += 1


def router_app(fleet: Fleet) -> web.Application:
    """The routing push API of a router, counting the endpoints of each table it takes."""
    held = {"epoch": 0, "version": 0, "applied": False}

    async def take(request: web.Request) -> web.Response:
        snapshot = json.loads(await request.read())
        held.update(epoch=snapshot["epoch"], version=snapshot["version"], applied=True)
        fleet.table = (snapshot["epoch"], sum(len(m["endpoints"]) for m in snapshot["models"]))
        return web.json_response(held)

    async def holds(request: web.Request) -> web.Response:
        return web.json_response(held)

    app = web.Application(client_max_size=1 << 30)
    app.router.add_put("/v1/routing", take)
    app.router.add_get("/v1/routing/held", holds)
    return app


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


class ControlPlaneProcess:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.process: subprocess.Popen[bytes] | None = None
        self.urls: dict[str, str] = {}

    async def start(self) -> None:
        ready = self.folder / "ready.json"
        ready.unlink(missing_ok=True)
        log = (self.folder / "control-plane.log").open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "modelfleet", "control-plane", "--config",
             str(self.folder / "control-plane.yaml"), "--ready-file", str(ready),
             "--log-level", "warning"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        await waited("the control plane's ready file", ready.exists, 60)
        self.urls = json.loads(ready.read_text())["urls"]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid


async def measure(
    nodes: int, steady_s: float, keep_log: Path | None, silence_s: float
) -> dict[str, Any]:
    fleet = Fleet()
    gc.set_threshold(50_000, 20, 100)
    replicas = 2 * nodes // MODELS * MODELS
    with tempfile.TemporaryDirectory(prefix="cp-scale-") as tmp:
        folder = Path(tmp)
        runner = web.AppRunner(router_app(fleet), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        router_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        (folder / "catalog.yaml").write_text(catalog(nodes, added=False))
        names = [f"node-{i:05d}" for i in range(nodes)]
        config = {
            "catalog": "catalog.yaml",
            "state_dir": "state",
            "agent_port": 0,
            "admin_port": 0,
            "admin_token": TOKEN,
            "insecure_agent_api": True,
            "routers": [{"url": f"http://127.0.0.1:{router_port}", "token": TOKEN}],
            # Settling ends once every node has reported: what an operator lists does it.
            "known_nodes": names,
            # The plots' points: a write for every node each SERIES_INTERVAL.
            "series_interval": SERIES_INTERVAL,
        }
        write_atomic(folder / "control-plane.yaml", yaml.safe_dump(config))  # it holds tokens
        cp = ControlPlaneProcess(folder)
        await cp.start()
        client = Upstreams(connect_timeout=10, idle_timeout=120)
        admin = aiohttp.ClientSession(headers={"authorization": f"Bearer {TOKEN}"})
        sims = [SimNode(i, fleet, client, cp.urls["agent"]) for i in range(nodes)]
        tasks = [asyncio.create_task(fleet.watch_lag())]
        try:
            for sim in sims:  # a few hundred agents starting per 10 ms, not all in one go
                tasks.append(asyncio.create_task(sim.run()))
                if len(tasks) % 300 == 0:
                    await asyncio.sleep(0.01)
            began = time.perf_counter()
            await waited(
                f"a routing table of all {replicas} replicas",
                lambda: fleet.table[1] >= replicas,
                600,
            )
            up_s = time.perf_counter() - began
            await waited("every agent beating", lambda: fleet.beating == nodes, 120, fleet.seen)
            # This process holds 10,000 simulated agents: kept out of its collector's sight,
            # as the control plane keeps its state, so that its pauses do not show as theirs.
            gc.freeze()

            async def status() -> dict[str, Any]:
                async with admin.get(f"{cp.urls['admin']}/v1/status") as response:
                    return dict(await response.json())

            interval = (await status())["heartbeat_interval"]
            await asyncio.sleep(interval)  # every agent's heartbeat is a held one by now

            # Steady: heartbeats only, and whole reports of unchanged nodes probing latency.
            async def probe() -> None:
                while True:
                    await random.choice(sims).send_report(probe=True)
                    await asyncio.sleep(0.05)

            prober = asyncio.create_task(probe())
            fleet.measuring = True
            cpu0, wall0 = cpu_seconds(cp.pid), time.perf_counter()
            await asyncio.sleep(max(steady_s, 2 * interval))
            steady_wall = time.perf_counter() - wall0
            cpu_s_per_s = (cpu_seconds(cp.pid) - cpu0) / steady_wall
            fleet.measuring = False
            prober.cancel()
            steady = await status()
            rss = rss_mb(cp.pid)

            # A catalog change adding 1,000 replicas, until each agent concerned holds its shard.
            began = time.perf_counter()
            async with admin.put(
                f"{cp.urls['admin']}/v1/catalog", data=catalog(nodes, added=True)
            ) as response:
                assert response.status == 200, await response.text()
                put_s = time.perf_counter() - began
            await waited(f"{ADDED} replicas assigned", lambda: fleet.added_shards >= ADDED, 120)
            assigned_s = time.perf_counter() - began
            replicas += ADDED
            await waited(
                f"a routing table of all {replicas} replicas",
                lambda: fleet.table[1] >= replicas,
                120,
            )
            await waited("every agent beating", lambda: fleet.beating == nodes, 120, fleet.seen)

            # A restart on the same state dir, until every replica is adopted and routed.
            epoch = fleet.table[0]
            began = time.perf_counter()
            cp.stop()
            stop_s = time.perf_counter() - began
            started, dropped = fleet.started, fleet.dropped
            began, own_cpu = time.perf_counter(), time.process_time()
            await cp.start()
            ready_s = time.perf_counter() - began
            for sim in sims:
                sim.url = cp.urls["agent"]
            await waited(
                "every agent reporting again", lambda: fleet.beating == nodes, 300, fleet.seen
            )
            reported_s = time.perf_counter() - began
            await waited(
                "a full routing table from the restarted control plane",
                lambda: fleet.table[0] > epoch and fleet.table[1] >= replicas,
                300,
            )
            adopt_s = time.perf_counter() - began
            restart_cpu = {
                "control_plane": cpu_seconds(cp.pid),
                "bench": time.process_time() - own_cpu,
            }
            churn = fleet.started - started + fleet.dropped - dropped

            # Every agent falls silent at once (the control plane's network is cut off): the
            # nodes go stale, then lost, and nothing may be moved; what does it cost, and does
            # the control plane still stop at once?
            silent: dict[str, float] = {}
            if silence_s > 0:
                for task in tasks[1:]:
                    task.cancel()
                await asyncio.gather(*tasks[1:], return_exceptions=True)
                client.close()
                cpu0, wall0 = cpu_seconds(cp.pid), time.perf_counter()
                await asyncio.sleep(silence_s)
                silent["cpu_s_per_s"] = round(
                    (cpu_seconds(cp.pid) - cpu0) / (time.perf_counter() - wall0), 3
                )
                began = time.perf_counter()
                cp.stop()
                silent["stop_s"] = round(time.perf_counter() - began, 2)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            client.close()
            await admin.close()
            cp.stop()
            await runner.cleanup()
            if keep_log is not None:
                keep_log.write_bytes((folder / "control-plane.log").read_bytes())
    return {
        "nodes": nodes,
        "replicas": replicas,
        "up_s": round(up_s, 2),
        "heartbeat_interval_s": interval,
        "cpu_s_per_s": round(cpu_s_per_s, 3),
        "report_p50_ms": round(statistics.median(fleet.report_ms), 2),
        "report_p99_ms": round(percentile(fleet.report_ms, 0.99), 2),
        "reports_probed": len(fleet.report_ms),
        "beats_per_s": round(fleet.beats / steady_wall, 1),
        "catalog_put_s": round(put_s, 2),
        "catalog_to_assignments_s": round(assigned_s, 2),
        "stop_s": round(stop_s, 2),
        "restart_ready_s": round(ready_s, 2),
        "restart_reported_s": round(reported_s, 2),
        "adopt_s": round(adopt_s, 2),
        "restart_churn": churn,
        "all_silent": silent,
        "restart_cpu_s": {k: round(v, 2) for k, v in restart_cpu.items()},
        "idle_pass_ms": steady["last_idle_pass_ms"],
        "plan_ms": steady["last_plan_ms"],
        "rss_mb": round(rss, 1),
        "exchange_errors": fleet.errors,
        "bench_loop_lag_p99_ms": round(percentile(fleet.lag_ms, 0.99), 2),
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else math.nan


def main() -> None:
    end_on_sigterm()
    # SIGTERM ends the run as ^C does, through the `finally` that stops the control plane.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,5000,10000")
    parser.add_argument("--steady", type=float, default=20.0, help="seconds of steady fleet")
    parser.add_argument("--logs", type=Path, help="keep each size's control-plane log here")
    parser.add_argument(
        "--silence", type=float, default=0.0,
        help="then let every agent fall silent this many seconds (90: past the lost time)",
    )  # fmt: skip
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {}
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    for size in sizes:
        log = args.logs / f"control-plane-{size}.log" if args.logs else None
        result = uvloop.run(
            measure(size, args.steady, log, args.silence)
        )  # the simulated agents' loop
        results[size] = result
        json_line(result)
    keys = ("cpu_s_per_s", "report_p99_ms", "catalog_to_assignments_s", "adopt_s",
            "idle_pass_ms", "rss_mb")  # fmt: skip
    if len(sizes) > 1:
        small, large = sizes[0], sizes[-1]
        per_tenfold = math.log10(large / small)
        for key in keys:
            a, b = results[small][key], results[large][key]
            if a and b:
                growth = (b / a) ** (1 / per_tenfold)
                print(f"{key}: x{growth:.1f} per tenfold ({small} -> {large} nodes)")
    last = results[sizes[-1]]
    summary: dict[str, Any] = {
        "cpu_s_per_s": {str(s): results[s]["cpu_s_per_s"] for s in sizes},
        "report_p99_ms": {str(s): results[s]["report_p99_ms"] for s in sizes},
    }
    for key in ("catalog_to_assignments_s", "adopt_s", "restart_churn", "idle_pass_ms", "rss_mb"):
        summary[f"{key}_{sizes[-1]}"] = last[key]
    json_line(summary)


if __name__ == "__main__":
    main()
