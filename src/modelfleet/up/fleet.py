"""Starting a fleet: router, control plane and agents, each once its predecessor listens."""

from __future__ import annotations

import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from modelfleet.apikeys import hash_key
from modelfleet.catalog import Catalog
from modelfleet.files import private_dir, write_atomic
from modelfleet.processes import ProcessId, stop_groups
from modelfleet.up.children import Fleet, Leftovers, UpError, agent_state_dir
from modelfleet.up.configs import DEFAULT_CATALOG, REAL_GPUS, FleetOptions
from modelfleet.up.kept import HOST, Kept, load_or_make
from modelfleet.wire import RoutingSnapshot


@dataclass
class RunningFleet:
    """A started fleet: its processes and what a client and an operator need to reach it."""

    fleet: Fleet
    catalog_file: Path
    router_url: str
    push_url: str
    admin_url: str
    admin_token: str
    api_key: str
    agent_token: str
    agent_admin: dict[str, str]  # node -> its agent's admin API (simulated GPU faults)
    notes: list[str]  # what moved since the last `up` on this state dir

    def info(self) -> dict[str, Any]:
        return {
            "router_url": self.router_url,
            "admin_url": self.admin_url,
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
    loaded = load_or_make(state_dir, opts.router_port, opts.limits_store, opts.redis, held)
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
            _start_redis(fleet, state_dir, kept.redis_port, adoptable.pop("redis", None), notes)
        router_urls = _start_router(
            fleet, state_dir, kept, unchanged, adoptable.pop("router", None), notes
        )
        for role, process in adoptable.items():  # left running, and not wanted now
            stop_groups([process.pid], 10.0)
            notes.append(f"stopped the {role} an earlier `up` left running (pid {process.pid})")

        cp_cfg = {
            "catalog": str(catalog_file),
            "state_dir": str(state_dir / "control-plane"),
            "agent_port": kept.agent_port,
            "admin_port": kept.admin_port,
            "admin_token": admin_token,
            "agent_token": agent_token,
            "routers": [
                {"url": router_urls["push"], "token": admin_token},
                *({"url": url, "token": admin_token} for url in opts.extra_routers),
            ],
            "known_nodes": list(opts.nodes),
            "reconcile_interval": opts.reconcile_interval,
            "heartbeat_interval": opts.report_interval,
            **opts.control_plane,
        }
        write_atomic(state_dir / "control-plane.yaml", yaml.safe_dump(cp_cfg))
        cp = fleet.spawn(
            "control-plane",
            ["control-plane", "--config", str(state_dir / "control-plane.yaml")],
            ready_file=run_dir / "control-plane.json",
        )
        cp_urls = fleet.wait_ready(cp, 15)["urls"]

        agents = []
        for node in opts.nodes:
            args = [
                "agent",
                "--control-plane",
                cp_urls["agent"],
                "--node",
                node,
                *(["--simulate-gpus", opts.gpus] if opts.gpus != REAL_GPUS else []),
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
    )


def _reads(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
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
    fleet: Fleet, state_dir: Path, port: int, left: ProcessId | None, notes: list[str]
) -> None:
    """Run Debian's redis-server for the router's limits (`up --redis`) in the state dir, on
    its kept port; adopt the one an earlier `up` left running if it answers there."""
    if left is not None and _pings(port):
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
    command = [binary, "--port", str(port), "--bind", HOST, "--dir", str(folder),
               "--save", "", "--appendonly", "no", "--protected-mode", "yes"]  # fmt: skip
    redis = fleet.spawn(
        "redis",
        [],
        command=command,
        ready_check=lambda: {"url": f"redis://{HOST}:{port}/0"} if _pings(port) else None,
    )
    fleet.wait_ready(redis, 15)


def _answers(url: str, token: str) -> bool:
    try:
        return httpx.get(url, headers={"authorization": f"Bearer {token}"}, timeout=2).is_success
    except httpx.HTTPError:
        return False


def _pings(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
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
