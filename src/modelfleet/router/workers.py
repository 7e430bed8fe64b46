"""Several router processes on one port, for when one core is not enough (`workers: N`).

Each worker is a whole router that binds the client port with SO_REUSEPORT, so the kernel
spreads new connections over them. The parent process holds the push API (`push.py`): a
table pushed to it goes on to every worker (each with a push port of its own on loopback)
and is confirmed only when every worker took it, so the control plane still sees one router.
The workers share the `table_file`, from which one that is restarted after a crash serves at
once. Each worker balances on its own in-flight counts and on the engines' queue depths,
which every worker reads from the engines themselves: the one count they share.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import yaml

from modelfleet.host.files import owned_temp_dir
from modelfleet.host.processes import port_holders
from modelfleet.http.serving import Listener, run_service
from modelfleet.http.web import JSON
from modelfleet.messages.wire import (
    Ejection,
    LoadReport,
    ModelLoad,
    RoutingAck,
    RoutingSnapshot,
    UsageAck,
    UsageBatch,
    UsageReport,
)
from modelfleet.router.config import WORKERS_TEMP_PREFIX, RouterConfig
from modelfleet.router.metrics import COUNTS_SUFFIX, last_shown, summed
from modelfleet.router.push import PushUnavailable, create_push_app

log = logging.getLogger("modelfleet.router")

SCRAPE_TIMEOUT = aiohttp.ClientTimeout(total=1.0)  # a worker slower than this is stalled


class PortHeld(Exception):
    """The client port is held by another process: the router does not start on it."""


class _Worker:
    """One worker process: its config, its ready file, and, once up, its push URL."""

    def __init__(self, index: int, folder: Path) -> None:
        self.index = index
        self.config_file = folder / f"worker-{index}.yaml"
        self.ready_file = folder / f"worker-{index}.json"
        self.counts_file = self.ready_file.with_suffix(COUNTS_SUFFIX)
        self.proc: subprocess.Popen[bytes] | None = None
        self.push_url: str | None = None

    def start(self) -> None:
        self.ready_file.unlink(missing_ok=True)
        self.push_url = None
        # In the parent's process group: whoever stops the router's group stops its workers.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "modelfleet", "router", "--config", str(self.config_file),
             "--ready-file", str(self.ready_file), "--log-level", "warning"],
            stdin=subprocess.DEVNULL,
        )  # fmt: skip

    async def ready(self, timeout: float = 60.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.ready_file.exists():
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"router worker {self.index} exited before it was ready")
            if loop.time() > deadline:
                raise RuntimeError(f"router worker {self.index} not ready within {timeout:.0f} s")
            await asyncio.sleep(0.05)
        self.push_url = json.loads(self.ready_file.read_text())["urls"]["push"]


class Workers:
    """The parent of the workers: starts and restarts them, and passes each push on."""

    def __init__(self, config_data: dict[str, object], workers: int, token: str | None) -> None:
        self.token = token
        self.data = config_data
        # Named with this process's pid, so that the next router removes it (and the push
        # token its workers' configs hold) if this one is killed before it can.
        self.folder = owned_temp_dir(WORKERS_TEMP_PREFIX)
        self.workers = [_Worker(i, self.folder) for i in range(workers)]
        self._session: aiohttp.ClientSession | None = None

    def write_configs(self, port: int) -> None:
        table_file = self.data.get("table_file") or str(self.folder / "table.json")
        for worker in self.workers:
            data = {
                **self.data,
                "port": port,
                "push_port": 0,
                "workers": 1,
                "reuse_port": True,
                "parent_push": True,
                "counts_file": str(worker.counts_file),
                "parent_pid": os.getpid(),
                "table_file": table_file,
            }
            worker.config_file.write_text(yaml.safe_dump(data))
            worker.config_file.chmod(0o600)

    async def start(self) -> None:
        for worker in self.workers:
            worker.start()
        await asyncio.gather(*(w.ready() for w in self.workers))

    async def supervise(self) -> None:
        """Restart a worker that exits; it serves the shared table file's table at once."""
        while True:
            for worker in self.workers:
                if worker.proc is not None and worker.proc.poll() is not None:
                    log.warning(
                        "router worker %d exited (%s); restarting it",
                        worker.index,
                        worker.proc.returncode,
                    )
                    worker.start()
                    with contextlib.suppress(RuntimeError):
                        await worker.ready()
            await asyncio.sleep(0.5)

    async def stop(self, grace: float = 30.0) -> None:
        """SIGTERM to every worker (each finishes what it has in flight), SIGKILL after
        `grace` seconds."""
        procs = [w.proc for w in self.workers if w.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                await asyncio.to_thread(proc.wait, grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        return self._session

    # -- the push API (`push.py`), passed on to every worker -------------------------------

    async def _each(self, method: str, path: str, body: bytes | None = None) -> list[RoutingAck]:
        """Every worker's answer to one push API call; a worker that cannot answer fails it."""
        headers = {"authorization": f"Bearer {self.token}", "content-type": JSON}

        async def one(worker: _Worker) -> RoutingAck:
            if worker.push_url is None:
                raise PushUnavailable(f"router worker {worker.index} is starting")
            url = worker.push_url + path
            async with self.session.request(method, url, data=body, headers=headers) as answer:
                return RoutingAck.model_validate_json(await answer.read())

        try:
            return list(await asyncio.gather(*(one(w) for w in self.workers)))
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise PushUnavailable(str(exc)) from exc

    async def take_table(self, snapshot: RoutingSnapshot, body: bytes) -> RoutingAck:
        """Taken only when every worker took it."""
        return _summary(await self._each("PUT", "/v1/routing", body))

    async def held(self) -> RoutingAck:
        return _summary(await self._each("GET", "/v1/routing/held"))

    async def metrics_text(self) -> bytes:
        """The workers' metrics summed; a worker that does not answer counts as what it last
        showed (`WorkerCounts`), so that the sum never goes back."""
        headers = {"authorization": f"Bearer {self.token}"}

        async def one(worker: _Worker) -> str | None:
            if worker.push_url is not None:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with self.session.get(
                        worker.push_url + "/v1/metrics", headers=headers, timeout=SCRAPE_TIMEOUT
                    ) as answer:
                        if answer.status == 200:
                            return await answer.text()
            return last_shown(worker.counts_file)

        texts = await asyncio.gather(*map(one, self.workers))
        return summed((text for text in texts if text is not None), same_engines=True)

    async def shown_table(self) -> bytes:
        worker = self.workers[0]
        if worker.push_url is None:
            raise PushUnavailable("router worker 0 is starting")
        headers = {"authorization": f"Bearer {self.token}"}
        try:
            url = worker.push_url + "/v1/routing"
            async with self.session.get(url, headers=headers) as answer:
                return await answer.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise PushUnavailable(str(exc)) from exc

    async def usage(self) -> UsageReport:
        """Every worker's batch; a worker that does not answer now is asked next time."""
        headers = {"authorization": f"Bearer {self.token}"}

        async def one(worker: _Worker) -> list[UsageBatch]:
            if worker.push_url is None:
                return []
            try:
                url = worker.push_url + "/v1/usage"
                async with self.session.get(url, headers=headers) as answer:
                    return UsageReport.model_validate_json(await answer.read()).batches
            except (aiohttp.ClientError, TimeoutError, ValueError):
                return []

        batches = [b for found in await asyncio.gather(*map(one, self.workers)) for b in found]
        return UsageReport(batches=batches)

    async def load(self, wait: float) -> LoadReport:
        """The workers' loads summed (the engines' own counts are each worker's reading of
        the same engines: the largest is kept). The long poll ends when the first worker's
        ends; the others are then asked at once."""
        headers = {"authorization": f"Bearer {self.token}"}

        async def one(worker: _Worker, wait: float) -> LoadReport:
            if worker.push_url is None:
                raise PushUnavailable(f"router worker {worker.index} is starting")
            url = f"{worker.push_url}/v1/load?wait={wait:g}"
            try:
                async with self.session.get(url, headers=headers) as answer:
                    return LoadReport.model_validate_json(await answer.read())
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                raise PushUnavailable(f"router worker {worker.index}: {exc}") from exc

        waits = {asyncio.ensure_future(one(w, wait)): w for w in self.workers}
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        reports = [task.result() for task in done]
        reports += await asyncio.gather(*(one(waits[task], 0) for task in pending))
        # Without a shared limits_store each worker counts keys' limits on its own.
        counts = 1 if self.data.get("limits_store") else len(self.workers)
        return _summed_loads(reports).model_copy(update={"limit_counts": counts})

    async def ack_usage(self, ack: UsageAck) -> None:
        """Pass the acknowledgement to every worker: each forgets the batches that are its."""
        body = ack.model_dump_json()
        headers = {"authorization": f"Bearer {self.token}", "content-type": JSON}

        async def one(worker: _Worker) -> None:
            if worker.push_url is None:
                return
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                url = worker.push_url + "/v1/usage/ack"
                async with self.session.post(url, data=body, headers=headers) as answer:
                    await answer.read()

        await asyncio.gather(*map(one, self.workers))


def _summed_loads(reports: list[LoadReport]) -> LoadReport:
    """One router's load from its workers': what each holds and sends is summed, the engines'
    own readings (requests there and KV cache in use, read by every worker from the same
    engines) are not: the largest is kept. A replica out of rotation at several workers is
    told once, with the longest time out."""
    models: dict[str, ModelLoad] = {}
    ejected: dict[str, Ejection] = {}
    for report in reports:
        for rid, ejection in report.ejected.items():
            if rid not in ejected or ejection.left_s > ejected[rid].left_s:
                ejected[rid] = ejection
        for name, load in report.models.items():
            was = models.get(name, ModelLoad())
            replicas = dict(was.replicas)
            for rid, (sent, engine) in load.replicas.items():
                had_sent, had_engine = replicas.get(rid, (0, 0))
                replicas[rid] = (had_sent + sent, max(had_engine, engine))
            cache = dict(was.cache)
            for rid, share in load.cache.items():
                cache[rid] = max(cache.get(rid, 0.0), share)
            models[name] = ModelLoad(
                in_flight=was.in_flight + load.in_flight,
                held=was.held + load.held,
                engines=max(was.engines, load.engines),
                replicas=replicas,
                cache=cache,
                rate=was.rate + load.rate,
                waited=max(was.waited, load.waited),
            )
    return LoadReport(models=models, ejected=ejected)


def _summary(acks: list[RoutingAck]) -> RoutingAck:
    """One answer for all workers: taken only if every one took it, at the oldest version held."""
    oldest = min(acks, key=lambda a: (a.epoch, a.version))
    return RoutingAck(
        applied=all(a.applied for a in acks), epoch=oldest.epoch, version=oldest.version
    )


def reserve_port(host: str, port: int) -> socket.socket:
    """Bind (not listen) `host:port` with SO_REUSEPORT: it picks the port for port 0 and holds
    it while the workers bind it too; a socket that does not listen takes no connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


async def serve_workers(
    config_data: dict[str, object], config: RouterConfig, ready_file: Path | None
) -> None:
    """Run `config.workers` router processes on one client port (each serving TLS with the
    client certificate where there is one), and the push API in this one."""
    host, token = config.host, config.push_token
    held = port_holders(host, config.port) if config.port else None
    if held is not None:
        who = f" by pid {', '.join(map(str, held))}" if held else ""
        raise PortHeld(
            f"port {config.port} on {host} is held{who}: with SO_REUSEPORT the workers would "
            "share it without a word (workers a killed router left behind?); stop that, then "
            "start the router again"
        )
    reserved = reserve_port(host, config.port)
    port = reserved.getsockname()[1]
    parent = Workers(config_data, config.workers, token)
    parent.write_configs(port)
    await parent.start()
    push_app = create_push_app(parent, token)
    listener = Listener("push", push_app, host, config.push_port, tls=config.push_tls)
    listener.bind()
    # Served by the workers; named here for its URL.
    client = Listener("router", None, host, port, tls=config.client_tls)
    try:
        await run_service(
            [listener],
            ready_file=ready_file,
            loops=[parent.supervise],
            on_stop=parent.stop,
            ready_extra={
                "urls": {"router": client.url, "push": listener.url},
                "workers": [w.proc.pid for w in parent.workers if w.proc is not None],
            },
        )
    finally:
        reserved.close()
        await parent.stop()
        # Its worker configs and ready files, and the table file unless the config named one.
        shutil.rmtree(parent.folder, ignore_errors=True)
