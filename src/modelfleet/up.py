"""`modelfleet up`: a whole fleet on one machine, with simulated GPUs and engines.

It starts, in this order, a router, a control plane and two agents (`node-1`, `node-2`, four
simulated 80 GB GPUs each), each as its own process and process group, waits until every
replica of the default catalog serves through the router, and writes what a client and an
operator need to `<state-dir>/up.json`. While the fleet runs, a process of it that dies is
started again and `up.json` rewritten with its new pid. SIGINT or SIGTERM stops everything it
started, engines included, in the reverse order.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from modelfleet.agent.supervisor import free_port, log_tail, signal_group
from modelfleet.catalog import Catalog
from modelfleet.router.table import hash_key
from modelfleet.serving import write_json_atomic

NODES = ("node-1", "node-2")
GPUS_PER_NODE = "4x80GB"

DEFAULT_CATALOG = """\
# The catalog `modelfleet up` serves. Edit it and run `modelfleet up` again.
models:
  - name: sim-chat
    engine: sim
    replicas: 2
    gpus_per_shard: 1
    gpu_memory: 20GiB
    args: ["--ttft", "0.05", "--itl", "0.01"]
  - name: sim-large
    engine: sim
    replicas: 1
    gpus_per_shard: 2
    gpu_memory: 60GiB
    args: ["--ttft", "0.2", "--itl", "0.02"]
"""


class UpError(RuntimeError):
    """`up` could not bring the fleet up; the message says which part and why."""


@dataclass
class Child:
    """One process `up` started; `restart` replaces `proc` with a new run of the same command."""

    role: str
    node: str | None
    args: list[str]
    env: dict[str, str]
    log: Path
    ready_file: Path | None
    proc: subprocess.Popen[bytes] = field(init=False)

    def launch(self) -> None:
        """Start `modelfleet ARGS` in its own process group, output appended to the log."""
        if self.ready_file is not None:
            self.ready_file.unlink(missing_ok=True)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "modelfleet", *self.args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches `up` alone, which stops all in order
                env={**os.environ, **self.env},
            )


@dataclass
class Fleet:
    """The processes `up` started, and how to stop them."""

    state_dir: Path
    children: list[Child] = field(default_factory=list)

    def spawn(
        self,
        role: str,
        args: list[str],
        node: str | None = None,
        env: dict[str, str] | None = None,
        ready_file: Path | None = None,
    ) -> Child:
        """Start `modelfleet ARGS` as a child of the fleet."""
        name = f"{role}-{node}" if node else role
        if ready_file is not None:
            args = [*args, "--ready-file", str(ready_file)]
        log = self.state_dir / "logs" / f"{name}.log"
        child = Child(role, node, args, env or {}, log, ready_file)
        child.launch()
        self.children.append(child)
        return child

    def restart(self, child: Child, timeout: float = 15) -> dict[str, Any]:
        """Stop `child` if it runs (SIGTERM, SIGKILL after 10 s), start it again, wait until
        it is ready; returns its ready file."""
        _stop_all([child.proc.pid], 10.0)
        child.proc.wait()
        child.launch()
        return self.wait_ready(child, timeout)

    def wait_ready(self, child: Child, timeout: float) -> dict[str, Any]:
        """Wait for the child's ready file; UpError with its log tail if it exits first."""
        assert child.ready_file is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if child.ready_file.exists():
                return json.loads(child.ready_file.read_text())
            if child.proc.poll() is not None:
                tail = "\n".join(log_tail(child.log, 20))
                raise UpError(f"{child.role} exited with code {child.proc.returncode}:\n{tail}")
            time.sleep(0.05)
        raise UpError(f"{child.role} was not ready within {timeout:.0f}s; see {child.log}")

    def engine_pids(self) -> dict[str, list[int]]:
        """The engines each agent recorded as started, by node."""
        found: dict[str, list[int]] = {}
        for node in sorted({c.node for c in self.children if c.node}):
            path = self.state_dir / "agents" / node / "shards.json"
            try:
                shards = json.loads(path.read_text())["shards"]
            except (OSError, ValueError, KeyError):
                continue
            found[node] = sorted(s["pid"] for s in shards.values() if s.get("pid"))
        return found

    def pids(self) -> dict[str, Any]:
        pids: dict[str, Any] = {"agent": {}, "engine": self.engine_pids()}
        for c in self.children:
            if c.node:
                pids[c.role][c.node] = c.proc.pid
            else:
                pids[c.role] = c.proc.pid
        return pids

    def stop(self) -> None:
        """Stop everything: control plane, agents, then the engines they left, router last."""
        engines = self.engine_pids()
        for role in ("control-plane", "agent"):
            _stop_all([c.proc.pid for c in self.children if c.role == role], 10.0)
        engines_now = self.engine_pids()  # the agents may have started more before they stopped
        all_engines = {p for pids in (*engines.values(), *engines_now.values()) for p in pids}
        _stop_all(sorted(all_engines), 15.0)
        _stop_all([c.proc.pid for c in self.children if c.role == "router"], 10.0)
        for c in self.children:
            if c.proc.poll() is None:
                c.proc.wait()


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        if waited == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop_all(pids: list[int], grace: float) -> None:
    """SIGTERM each process group, wait up to `grace`, SIGKILL what is left."""
    for pid in pids:
        signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in pids:
        if _alive(pid):
            signal_group(pid, signal.SIGKILL)
    while any(_alive(p) for p in pids):
        time.sleep(0.05)


def _running_fleet(state_dir: Path) -> int | None:
    try:
        up = json.loads((state_dir / "up.json").read_text())
        pid = int(up["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pid if pid != os.getpid() and _alive(pid) else None


def _wait_serving(push_url: str, token: str, catalog: Catalog, timeout: float) -> bool:
    """Wait until the router holds an endpoint for every replica of the catalog."""
    want = {m.name: m.replicas for m in catalog.models}
    deadline = time.monotonic() + timeout
    with httpx.Client(headers={"authorization": f"Bearer {token}"}, timeout=2) as http:
        while time.monotonic() < deadline:
            try:
                snap = http.get(f"{push_url}/v1/routing").json()
                have = {m["name"]: len(m["endpoints"]) for m in snap["models"]}
                if all(have.get(name, 0) >= n for name, n in want.items()):
                    return True
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.1)
    return False


@dataclass(frozen=True)
class FleetOptions:
    """The shape of a fleet `up` starts. The defaults are what `modelfleet up` runs."""

    nodes: tuple[str, ...] = NODES
    gpus: str = GPUS_PER_NODE  # every node's simulated GPUs
    router_port: int = 0
    report_interval: float = 1.0
    reconcile_interval: float = 0.5
    stop_grace: float = 10.0
    control_plane: dict[str, Any] = field(default_factory=dict)  # more control-plane settings
    agent_args: tuple[str, ...] = ()  # more agent flags


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


def start_fleet(state_dir: Path, options: FleetOptions | None = None) -> RunningFleet:
    """Start router, control plane and agents, each once its predecessor listens.

    The catalog is `<state_dir>/catalog.yaml` (written with the default catalog when absent);
    the control plane watches it. On an error the processes already started are stopped.
    """
    opts = options or FleetOptions()
    state_dir.mkdir(parents=True, exist_ok=True)
    run_dir = state_dir / "run"
    run_dir.mkdir(exist_ok=True)
    for stale in run_dir.glob("*.json"):
        stale.unlink()
    catalog_file = state_dir / "catalog.yaml"
    if not catalog_file.exists():
        catalog_file.write_text(DEFAULT_CATALOG)

    admin_token = secrets.token_urlsafe(24)
    agent_token = secrets.token_urlsafe(24)
    api_key = "mf-" + secrets.token_urlsafe(24)
    router_cfg = {
        # Fixed ports, chosen free now, so that a restarted process is found where it was.
        "port": opts.router_port or free_port("127.0.0.1"),
        "push_port": free_port("127.0.0.1"),
        "push_token": admin_token,
        "api_keys": [{"name": "up", "sha256": hash_key(api_key)}],
    }
    (state_dir / "router.yaml").write_text(yaml.safe_dump(router_cfg))

    fleet = Fleet(state_dir)
    try:
        router = fleet.spawn(
            "router",
            ["router", "--config", str(state_dir / "router.yaml")],
            ready_file=run_dir / "router.json",
        )
        router_urls = fleet.wait_ready(router, 15)["urls"]

        cp_cfg = {
            "catalog": str(catalog_file),
            "state_dir": str(state_dir / "control-plane"),
            "agent_port": free_port("127.0.0.1"),
            "admin_port": free_port("127.0.0.1"),
            "admin_token": admin_token,
            "agent_token": agent_token,
            "routers": [{"url": router_urls["push"], "token": admin_token}],
            "known_nodes": list(opts.nodes),
            "reconcile_interval": opts.reconcile_interval,
            **opts.control_plane,
        }
        (state_dir / "control-plane.yaml").write_text(yaml.safe_dump(cp_cfg))
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
                "--simulate-gpus",
                opts.gpus,
                "--state-dir",
                str(state_dir / "agents" / node),
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
        agent_admin = {}
        for child in agents:
            agent_admin[child.node] = fleet.wait_ready(child, 15)["urls"]["admin"]
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
    )


def up(state_dir: Path, router_port: int = 0, serve_timeout: float = 15.0) -> int:
    """Bring the fleet up, print how to use it, and stop it all on SIGINT/SIGTERM."""
    state_dir = state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    running = _running_fleet(state_dir)
    if running is not None:
        raise UpError(f"a fleet is already running from {state_dir} (pid {running}); stop it first")
    catalog_file = state_dir / "catalog.yaml"
    if catalog_file.exists():  # refuse a broken file before starting anything
        Catalog.from_yaml(catalog_file.read_text(), source=str(catalog_file))

    stopping = False

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    fleet = start_fleet(state_dir, FleetOptions(router_port=router_port))
    try:
        catalog = Catalog.from_yaml(catalog_file.read_text(), source=str(catalog_file))
        serving = _wait_serving(fleet.push_url, fleet.admin_token, catalog, serve_timeout)
        info = fleet.info()
        write_json_atomic(state_dir / "up.json", info)
        _print_summary(info, catalog, state_dir, serving)

        keeper = Restarts()
        while not stopping:
            if keeper.tend(fleet, lambda: stopping):
                write_json_atomic(state_dir / "up.json", fleet.info())
            time.sleep(0.2)
    finally:
        print("stopping the fleet ...", flush=True)
        fleet.fleet.stop()
        (state_dir / "up.json").unlink(missing_ok=True)
    print("stopped.", flush=True)
    return 0


@dataclass
class Restarts:
    """`up` as a service manager: a process of the fleet that dies is started again, at once
    the first time, then after a delay that doubles (to 30 s) while it keeps dying within
    30 s of its start. An agent's engines are not restarted: they outlive it, and the new
    agent adopts them."""

    delay: dict[int, float] = field(default_factory=dict)  # id(child) -> next delay
    due: dict[int, float] = field(default_factory=dict)  # id(child) -> when to restart it
    started: dict[int, float] = field(default_factory=dict)  # id(child) -> last restart

    def tend(self, fleet: RunningFleet, stopping: Callable[[], bool]) -> bool:
        """Restart what died and is due; True when anything was restarted."""
        restarted = False
        now = time.monotonic()
        for c in fleet.fleet.children:
            if c.proc.poll() is None or stopping():
                continue
            key = id(c)
            where = f" on {c.node}" if c.node else ""
            if key not in self.due:
                delay = self.delay.get(key, 0.0)
                self.due[key] = now + delay
                print(
                    f"warning: {c.role}{where} exited with code {c.proc.returncode}; "
                    f"restarting it in {delay:.0f}s (log: {c.log})",
                    flush=True,
                )
            if now < self.due[key]:
                continue
            del self.due[key]
            try:
                ready = fleet.fleet.restart(c)
            except UpError as exc:
                print(f"warning: {c.role}{where} did not come back: {exc}", flush=True)
                self.delay[key] = min(30.0, max(1.0, 2 * self.delay.get(key, 0.0)))
                continue
            if c.role == "agent" and c.node:
                fleet.agent_admin[c.node] = ready["urls"]["admin"]
            print(f"{c.role}{where} restarted: pid {c.proc.pid}", flush=True)
            self.delay[key] = min(30.0, max(1.0, 2 * self.delay.get(key, 0.0)))
            self.started[key] = time.monotonic()
            restarted = True
        for key, since in list(self.started.items()):
            if time.monotonic() - since > 30:  # it has stayed up: the next death restarts at once
                self.delay.pop(key, None)
                del self.started[key]
        return restarted


def _print_summary(info: dict[str, Any], catalog: Catalog, state_dir: Path, serving: bool) -> None:
    first = catalog.models[0].name if catalog.models else "MODEL"
    body = json.dumps({"model": first, "messages": [{"role": "user", "content": "Hello!"}]})
    models = ", ".join(
        f"{m.name} ({m.replicas} replica{'s' if m.replicas > 1 else ''})" for m in catalog.models
    )
    lines = [
        f"modelfleet is up  (state: {state_dir})",
        f"  router url:  {info['router_url']}   OpenAI-compatible, send the API key",
        f"  admin url:   {info['admin_url']}   token: {info['admin_token']}",
        f"  api key:     {info['api_key']}",
        f"  models:      {models}",
    ]
    if not serving:
        lines.append("  warning: not every replica serves yet; `modelfleet ctl replicas` says why")
    lines += [
        "",
        "Try it:",
        f"  curl -s {info['router_url']}/v1/chat/completions \\",
        f"    -H 'Authorization: Bearer {info['api_key']}' -H 'Content-Type: application/json' \\",
        f"    -d '{body}'",
        "",
        "  modelfleet ctl nodes        modelfleet ctl replicas",
        "",
        f"Everything above is also in {state_dir / 'up.json'}. Ctrl-C stops the whole fleet.",
    ]
    print("\n".join(lines), flush=True)
