"""Starting a fleet: router, control plane and agents, each once its predecessor listens."""

from __future__ import annotations

import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import yaml

from modelfleet.core import yamltext
from modelfleet.core.catalog import Catalog
from modelfleet.host.files import private_dir, write_atomic
from modelfleet.host.pgserver import PgServer, PgServerError, redacted
from modelfleet.host.processes import ProcessId, log_tail, stop_groups
from modelfleet.messages.wire import RoutingSnapshot
from modelfleet.security.apikeys import hash_key
from modelfleet.up.children import Child, Fleet, Leftovers, UpError, agent_state_dir
from modelfleet.up.configs import DEFAULT_CATALOG, FleetOptions, agent_gpu_flags
from modelfleet.up.kept import HOST, Kept, load_or_make

# A fleet on one machine is small: its plots get a point every 10 s, not every minute.
UP_SERIES_INTERVAL = 10


@dataclass
class RunningFleet:
    """A started fleet: its processes and what a client and an operator need to reach it."""

    fleet: Fleet
    catalog_file: Path
    router_url: str
    push_url: str
    admin_url: str  # the first control plane's; every one's in `admin_urls`
    admin_token: str
    api_key: str
    agent_token: str
    agent_admin: dict[str, str]  # node -> its agent's admin API (simulated GPU faults)
    notes: list[str]  # what moved since the last `up` on this state dir
    admin_urls: list[str] = field(default_factory=list)  # of every control plane
    agent_urls: list[str] = field(default_factory=list)  # of every control plane
    store: str = ""  # the control planes' store, password left out

    def info(self) -> dict[str, Any]:
        return {
            "router_url": self.router_url,
            "admin_url": self.admin_url,
            "admin_urls": self.admin_urls,
            "agent_urls": self.agent_urls,
            "store": self.store,
            "admin_token": self.admin_token,
            "api_key": self.api_key,
            "agent_admin": self.agent_admin,
            "agent_token": self.agent_token,
            "pid": os.getpid(),
            "pids": self.fleet.pids(),
            "catalog": str(self.catalog_file),
        }


def start_fleet(
    state_dir: Path, options: FleetOptions | None = None, leftovers: Leftovers | None = None
) -> RunningFleet:
    """Start router, control plane and agents, each once its predecessor listens.

    The catalog is `<state_dir>/catalog.yaml` (written with the default catalog when absent);
    the control plane watches it. A router (and a Redis) an earlier `up` left running
    (`leftovers`) is adopted when it runs with the config this one would give it and answers;
    otherwise it is stopped and started anew. On an error the processes already started are
    stopped.
    """
    opts = options or FleetOptions()
    adoptable = dict(leftovers.adoptable) if leftovers else {}
    private_dir(state_dir)
    run_dir = private_dir(state_dir / "run")
    for stale in run_dir.glob("*.json"):
        stale.unlink()
    catalog_file = state_dir / "catalog.yaml"
    if not catalog_file.exists():
        catalog_file.write_text(DEFAULT_CATALOG)

    held = frozenset({"router_port", "push_port"} if "router" in adoptable else ())
    loaded = load_or_make(
        state_dir,
        opts.router_port,
        opts.limits_store,
        opts.redis,
        held,
        store=opts.store,
        control_planes=opts.control_planes,
    )
    kept = loaded.kept
    notes = list(loaded.notes)
    admin_token, agent_token, api_key = kept.admin_token, kept.agent_token, kept.api_key
    router_cfg: dict[str, Any] = {
        # Fixed ports, kept across restarts, so that a restarted process is found where it
        # was and a client configured yesterday finds the router where it was.
        "port": kept.router_port,
        "push_port": kept.push_port,
        "push_token": admin_token,
        "table_file": str(state_dir / "router-table.json"),
        "api_keys": [{"name": "up", "sha256": hash_key(api_key)}],
        **({"limits_store": kept.limits_url} if kept.limits_url else {}),
        **opts.router,
    }
    router_file = state_dir / "router.yaml"
    unchanged = _reads(router_file) == router_cfg
    write_atomic(router_file, yaml.safe_dump(router_cfg))

    fleet = Fleet(state_dir)
    try:
        if kept.redis_port is not None:
            _start_redis(fleet, state_dir, kept, adoptable.pop("redis", None), notes)
        router_urls = _start_router(
            fleet, state_dir, kept, unchanged, adoptable.pop("router", None), notes
        )
        for role, process in adoptable.items():  # left running, and not wanted now
            stop_groups([process.pid], 10.0)
            notes.append(f"stopped the {role} an earlier `up` left running (pid {process.pid})")

        if opts.control_planes > 1 and kept.store is None:
            raise UpError(
                f"{opts.control_planes} control planes share one store, which SQLite cannot "
                "be: add --store postgres (`up` runs one in the state dir) or a PostgreSQL URL"
            )
        store_url = kept.store
        if kept.store == "postgres":
            assert kept.postgres_port is not None
            store_url = _start_postgres(fleet, state_dir, kept.postgres_port)
        ports = [(kept.agent_port, kept.admin_port), *kept.more_control_planes]
        common = {
                "catalog": str(catalog_file),
                "admin_token": admin_token,
                "agent_token": agent_token,
                "routers": [
                    {"url": router_urls["push"], "token": admin_token,
                     "client_url": router_urls["router"]},
                    *({"url": url, "token": admin_token} for url in opts.extra_routers),
                ],
                "known_nodes": list(opts.nodes),
                "reconcile_interval": opts.reconcile_interval,
                "heartbeat_interval": opts.report_interval,
                "series_interval": UP_SERIES_INTERVAL,
                **({"store": store_url} if store_url else {}),
                **opts.control_plane,
        }  # fmt: skip
        # The first leads (the others start once it does), then the others follow it.
        first = _start_control_plane(fleet, state_dir, 1, ports[0], common)
        every_cp = [fleet.wait_ready(first, 15)["urls"]]
        more = [
            _start_control_plane(fleet, state_dir, i + 1, ports[i], common)
            for i in range(1, opts.control_planes)
        ]
        every_cp += [fleet.wait_ready(cp, 15)["urls"] for cp in more]
        cp_urls = every_cp[0]

        agents = []
        for node in opts.nodes:
            args = [
                "agent",
                "--control-plane",
                ",".join(u["agent"] for u in every_cp),
                "--node",
                node,
                *agent_gpu_flags(opts.gpus),
                "--state-dir",
                str(agent_state_dir(state_dir, node)),
                "--report-interval",
                str(opts.report_interval),
                "--stop-grace",
                str(opts.stop_grace),
                "--admin-port",
                "0",
                *opts.agent_args,
            ]
            # The token goes by environment, not argv, where any local user could read it.
            env = {"MODELFLEET_AGENT_TOKEN": agent_token}
            ready = run_dir / f"agent-{node}.json"
            agents.append(fleet.spawn("agent", args, node=node, env=env, ready_file=ready))
        agent_admin: dict[str, str] = {}
        for node, child in zip(opts.nodes, agents, strict=True):
            agent_admin[node] = fleet.wait_ready(child, 15)["urls"]["admin"]
    except BaseException:
        fleet.stop()
        raise
    return RunningFleet(
        fleet,
        catalog_file,
        router_urls["router"],
        router_urls["push"],
        cp_urls["admin"],
        admin_token,
        api_key,
        agent_token,
        agent_admin,
        notes,
        admin_urls=[u["admin"] for u in every_cp],
        agent_urls=[u["agent"] for u in every_cp],
        store=redacted(store_url) if store_url else "SQLite",
    )


def _start_control_plane(
    fleet: Fleet, state_dir: Path, number: int, ports: tuple[int, int], common: dict[str, Any]
) -> Child:
    """Start control plane `number` (1, 2, ...) with its kept ports; the first keeps the
    names it always had (control-plane/, control-plane.yaml)."""
    name = "control-plane" if number == 1 else f"control-plane-{number}"
    config = {
        "state_dir": str(state_dir / name),
        "agent_port": ports[0],
        "admin_port": ports[1],
        **common,
    }
    write_atomic(state_dir / f"{name}.yaml", yaml.safe_dump(config))
    return fleet.spawn(
        "control-plane",
        ["control-plane", "--config", str(state_dir / f"{name}.yaml")],
        ready_file=state_dir / "run" / f"{name}.json",
        label=name,
    )


def _start_postgres(fleet: Fleet, state_dir: Path, port: int) -> str:
    """Run Debian's PostgreSQL in `<state_dir>/postgres` on its kept port, as a process of the
    fleet (made on the first `up --store postgres`); returns its conninfo. Run as root, the
    server runs as the `postgres` user, which must reach its folder: the state dir is made
    enterable (not readable) by others; everything in it stays its owner's alone."""
    server = PgServer(state_dir / "postgres", port)
    try:
        if os.geteuid() == 0:
            os.chmod(state_dir, 0o711)
        server.init()
        conninfo = server.conninfo()
    except (PgServerError, OSError) as exc:
        raise UpError(f"cannot make the PostgreSQL of --store postgres: {exc}") from exc

    def answers() -> dict[str, Any] | None:
        try:
            with psycopg.connect(conninfo, connect_timeout=1):
                return {"url": redacted(conninfo)}
        except psycopg.Error:
            return None

    child = fleet.spawn(
        "postgres", [], command=server.server_command(), ready_check=answers, label="postgres"
    )
    try:
        server.create_database()  # tried until the server takes it (there already: nothing)
    except PgServerError as exc:
        tail = "\n".join(log_tail(child.log, 20))
        raise UpError(f"{exc}\nthe server's log ({child.log}):\n{tail}") from exc
    fleet.wait_ready(child, 30)
    return conninfo


def _reads(path: Path) -> Any:
    try:
        return yamltext.load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def _start_router(
    fleet: Fleet,
    state_dir: Path,
    kept: Kept,
    unchanged: bool,
    left: ProcessId | None,
    notes: list[str],
) -> dict[str, str]:
    """Start the router, or adopt the one an earlier `up` left running: when its config is
    the one it would be given now and it answers on its push API. A new router would refuse
    clients while it starts (19 of 960 requests in 0.9 s, measured)."""
    args = ["router", "--config", str(state_dir / "router.yaml")]
    ready = state_dir / "run" / "router.json"
    urls = {
        "router": f"http://{HOST}:{kept.router_port}",
        "push": f"http://{HOST}:{kept.push_port}",
    }
    if left is not None:
        if unchanged and _answers(urls["push"] + "/v1/routing/held", kept.admin_token):
            fleet.spawn("router", args, ready_file=ready, adopt=left)
            notes.append(
                f"the router an earlier `up` left running serves on: adopted (pid {left.pid})"
            )
            return urls
        stop_groups([left.pid], 10.0)
        why = "its config changed" if not unchanged else "it did not answer"
        notes.append(f"stopped the router an earlier `up` left running ({why}); started anew")
    router = fleet.spawn("router", args, ready_file=ready)
    found: dict[str, str] = fleet.wait_ready(router, 15)["urls"]
    return found


def _start_redis(
    fleet: Fleet, state_dir: Path, kept: Kept, left: ProcessId | None, notes: list[str]
) -> None:
    """Run Debian's redis-server for the router's limits (`up --redis`) in the state dir, on
    its kept port, with its kept password; adopt the one an earlier `up` left running if it
    answers there to that password (one that takes no password is stopped).

    Its settings, the password with them, are in `<state_dir>/redis/redis.conf` (0600), not
    on its command line, which any local user can read."""
    port, password = kept.redis_port, kept.redis_password
    assert port is not None and password is not None
    if left is not None and _pings(port, password):
        fleet.spawn("redis", [], command=["redis-server"], adopt=left)
        notes.append(f"the Redis an earlier `up` left running serves on: adopted (pid {left.pid})")
        return
    if left is not None:
        stop_groups([left.pid], 10.0)
    binary = shutil.which("redis-server")
    if binary is None:
        raise UpError(
            "--redis runs Debian's redis-server, which is not installed: "
            "`apt-get install redis-server`, or give --limits-store URL of a Redis you run"
        )
    folder = private_dir(state_dir / "redis")
    settings = {
        "port": port, "bind": HOST, "dir": f'"{folder}"', "save": '""', "appendonly": "no",
        "protected-mode": "yes", "requirepass": password,
    }  # fmt: skip
    conf = folder / "redis.conf"
    write_atomic(conf, "".join(f"{name} {value}\n" for name, value in settings.items()))
    redis = fleet.spawn(
        "redis",
        [],
        command=[binary, str(conf)],
        ready_check=lambda: {"url": f"redis://{HOST}:{port}/0"} if _pings(port, password) else None,
    )
    fleet.wait_ready(redis, 15)


def _answers(url: str, token: str) -> bool:
    try:
        return httpx.get(url, headers={"authorization": f"Bearer {token}"}, timeout=2).is_success
    except httpx.HTTPError:
        return False


def _pings(port: int, password: str) -> bool:
    """Whether the Redis on `port` takes `password` and answers."""
    try:
        with socket.create_connection((HOST, port), timeout=0.5) as sock:
            sock.sendall(f"AUTH {password}\r\nPING\r\n".encode())
            answer = b""
            while answer.count(b"\r\n") < 2 and (got := sock.recv(64)):
                answer += got
            return answer == b"+OK\r\n+PONG\r\n"
    except OSError:
        return False


def wait_serving(push_url: str, token: str, catalog: Catalog, timeout: float) -> bool:
    """Wait until the router holds an endpoint for every replica of the catalog."""
    want = {m.name: m.replicas for m in catalog.models}
    deadline = time.monotonic() + timeout
    with httpx.Client(headers={"authorization": f"Bearer {token}"}, timeout=2) as http:
        while time.monotonic() < deadline:
            try:
                snap = RoutingSnapshot.model_validate_json(
                    http.get(f"{push_url}/v1/routing").content
                )
                have = {m.name: len(m.endpoints) for m in snap.models}
                if all(have.get(name, 0) >= n for name, n in want.items()):
                    return True
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.1)
    return False
