"""Helpers for tests that run real modelfleet processes on 127.0.0.1.

Every process is started in its own process group and ended by that group, never by name.
Readiness is the process's own ready file (written once it listens), not polling its port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from modelfleet.host.processes import stop_groups
from modelfleet.http.loadgen import SteadyClient
from modelfleet.up import FleetOptions, RunningFleet, start_fleet

from .vllm_kit import vllm  # noqa: F401 -- a fixture of the real_vllm tests


@pytest.fixture(scope="session", autouse=True)
def _sigterm_unwinds() -> Iterator[None]:
    """A run stopped with SIGTERM (a CI job's timeout, `kill`) unwinds as Ctrl-C does, so
    that each test's fleet and processes are stopped by their own cleanup: they run in
    sessions of their own, and would outlive a run killed outright."""

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"stopped by signal {signum}")

    before = signal.signal(signal.SIGTERM, interrupted)
    yield
    signal.signal(signal.SIGTERM, before)


class Procs:
    """The processes one test started; all of them are ended when the test ends."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, *args: str, log: str) -> subprocess.Popen[bytes]:
        out = (self.tmp / f"{log}.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "modelfleet", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.started.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text() if path.exists() else ""

    def stop_all(self) -> None:
        stop_groups([p.pid for p in self.started], grace=20)
        for proc in self.started:
            proc.wait()


def wait_json(path: Path, proc: subprocess.Popen[bytes], timeout: float = 30) -> dict[str, Any]:
    """Wait for a process's ready (or up.json) file; fail at once if the process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        if proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode} before writing {path}")
        time.sleep(0.05)
    raise AssertionError(f"{path} did not appear within {timeout}s")


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()


def wait_for(what: str, check: Callable[[], Any], timeout: float = 30, every: float = 0.05) -> Any:
    """Call `check` until it returns something true, and return that; fail after `timeout`.

    A connection error counts as "not yet": a service that is being restarted refuses.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if result := check():
                return result
        except httpx.TransportError:
            pass
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def until(what: str, check: Callable[[], Any], timeout: float = 20) -> Any:
    """`wait_for` for a test running on an event loop: the loop keeps running meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@contextlib.contextmanager
def fleet_of(tmp: Path, models: list[dict[str, Any]], **options: Any) -> Iterator[RunningFleet]:
    """A fleet started as `modelfleet up` starts one (agents reporting every 0.5 s unless
    `options` say otherwise), serving `models`; every process of it is stopped afterwards."""
    state = tmp / "state"
    state.mkdir(exist_ok=True)  # a test may have made it, to learn the fleet's tokens first
    (state / "catalog.yaml").write_text(yaml.safe_dump({"models": models}))
    running = start_fleet(state, FleetOptions(**{"report_interval": 0.5, **options}))
    try:
        yield running
    finally:
        running.fleet.stop()


def wait_requests(client: SteadyClient, count: int, what: str = "") -> None:
    """Wait until `client` has had `count` more requests answered in full."""
    done = client.ok + count
    wait_for(f"{count} more requests answered{what}", lambda: client.ok >= done)


def ctl_target(fleet: RunningFleet) -> list[str]:
    """The flags that point `modelfleet ctl` at `fleet`'s admin API."""
    return ["--admin", fleet.admin_url, "--token", fleet.admin_token]


class Operator:
    """What an operator does to a running fleet: edit its catalog file, run `ctl`, read the
    admin API, make a simulated GPU fail."""

    def __init__(self, fleet: RunningFleet, tmp: Path) -> None:
        self.fleet = fleet
        self.tmp = tmp
        self.admin = httpx.Client(
            base_url=fleet.admin_url,
            headers={"authorization": f"Bearer {fleet.admin_token}"},
            timeout=10,
        )
        self.client = httpx.Client(
            base_url=fleet.router_url,
            headers={"authorization": f"Bearer {fleet.api_key}"},
            timeout=10,
        )

    def write_file(self, *models: dict[str, Any]) -> float:
        """Replace the watched catalog file the way an editor does; returns when."""
        tmp = self.fleet.catalog_file.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump({"models": list(models)}))
        os.replace(tmp, self.fleet.catalog_file)
        return time.monotonic()

    def ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`modelfleet ctl ARGS` against this fleet; with `check`, it must exit 0."""
        done = subprocess.run(
            [sys.executable, "-m", "modelfleet", "ctl", *args, *ctl_target(self.fleet)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if check:
            assert done.returncode == 0, done.stderr
        return done

    def apply(
        self, *models: dict[str, Any], check: bool = True
    ) -> tuple[float, subprocess.CompletedProcess[str]]:
        """`ctl catalog apply` of a file listing `models`; returns when it began, and ctl's run."""
        path = self.tmp / f"apply-{time.monotonic_ns()}.yaml"
        path.write_text(yaml.safe_dump({"models": list(models)}))
        began = time.monotonic()
        return began, self.ctl("catalog", "apply", str(path), check=check)

    def router_metrics(self) -> str:
        """The router's metrics, from its push API (with the fleet's admin token)."""
        auth = {"authorization": f"Bearer {self.fleet.admin_token}"}
        return httpx.get(f"{self.fleet.push_url}/metrics", headers=auth, timeout=10).text

    def get(self, path: str) -> Any:
        r = self.admin.get(path)
        assert r.status_code == 200, r.text
        return r.json()

    def replicas(self, model: str | None = None) -> list[dict[str, Any]]:
        return [
            r for r in self.get("/v1/replicas")["replicas"] if model is None or r["model"] == model
        ]

    def serves(self, model: str) -> bool:
        body = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        return self.client.post("/v1/chat/completions", json=body).status_code == 200

    def routed(self, model: str) -> list[str] | None:
        models = self.get("/v1/routing")["models"]
        return next((m["endpoints"] for m in models if m["name"] == model), None)

    def passes(self) -> int:
        """Reconcile passes the control plane has made since it started."""
        return int(self.get("/v1/status")["reconcile_passes"])

    def heard(self, node: str) -> int:
        """Reports and heartbeats the control plane has taken from `node` since it started."""
        found = next(n for n in self.get("/v1/nodes")["nodes"] if n["name"] == node)
        return int(found["reports"]) + int(found["heartbeats"])

    def wait_passes(self, count: int) -> None:
        """Wait until the control plane has made `count` more reconcile passes."""
        done = self.passes() + count
        wait_for(f"{count} more reconcile passes", lambda: self.passes() >= done)

    def used_gpus(self) -> set[tuple[str, int]]:
        nodes = self.get("/v1/nodes")["nodes"]
        return {(n["name"], g["index"]) for n in nodes for g in n["gpus"] if g["in_use"]}

    def gpu(self, node: str, index: int, healthy: bool, reason: str = "") -> None:
        """Make a simulated GPU fail (or recover) through its agent's admin API."""
        r = httpx.put(
            f"{self.fleet.agent_admin[node]}/v1/gpus/{index}/health",
            json={"healthy": healthy, "reason": reason},
            headers={"authorization": f"Bearer {self.fleet.agent_token}"},
            timeout=10,
        )
        assert r.status_code == 200, r.text
