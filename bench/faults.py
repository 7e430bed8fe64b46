"""What each fault costs the clients: a fleet under steady load, one fault after another.

Starts a fleet the way `modelfleet up` does (router, control plane, two agents with four
simulated GPUs each) in a temporary folder, with model `a` (two replicas) and model `b` (one),
and keeps a steady client on each (the project's loadgen: no retries, `--rate` requests/s in
all, streaming and not). Then, one after another, it makes each fault and waits until the
fleet has recovered from it: a drain, five cordon/uncordon rounds, a catalog roll of `a`,
kill -9 of the control plane, of an agent and of the router, kill -9 of one engine of `a` (of
two) and of the only engine of `b`, a hung engine (a model `h` whose engine stops answering
after a few seconds), and a GPU fault under `b`'s replica. For each it prints the requests
that ended while it lasted, how many of them failed, and the events it left that name its
cause (CAUSES); it ends with one JSON line, `events_per_fault` true when every fault left
them all.

    python bench/faults.py [--rate 20]

Target: zero failed requests, except while a process that clients reach is down: the router
(clients cannot connect) or the only engine of a model (until it is back).
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml
from kit import AdminFleet, end_on_sigterm, json_line
from kit import wait as _wait

from modelfleet.http.loadgen import SteadyClient
from modelfleet.up import FleetOptions, start_fleet

A = {"name": "a", "engine": "sim", "replicas": 2, "args": ["--itl", "0.005"]}
B = {"name": "b", "engine": "sim", "args": ["--itl", "0.005"]}
H = {"name": "h", "engine": "sim", "args": ["--hang-after", "4"]}


def wait(what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
    return _wait(what, check, timeout, ignore=(httpx.TransportError,))


class Fleet(AdminFleet):
    """The running fleet as an operator reaches it."""

    def ready(self, model: str) -> list[dict[str, Any]]:
        return [r for r in self.replicas(model) if r["state"] == "ready"]

    def settled(self, model: str, count: int) -> bool:
        reps = self.replicas(model)
        return len(reps) == count and all(r["state"] == "ready" for r in reps)

    def all_settled(self) -> bool:
        return self.settled("a", 2) and self.settled("b", 1)

    def child(self, role: str, node: str | None = None) -> Any:
        [c] = [c for c in self.running.fleet.children if c.role == role and c.node == node]
        return c

    def kill(self, role: str, node: str | None = None) -> None:
        child = self.child(role, node)
        os.kill(child.proc.pid, signal.SIGKILL)
        child.proc.wait()
        self.running.fleet.restart(child)
        if role == "control-plane":
            self.admin = self.connect()

    def kill_engine(self, replica: dict[str, Any]) -> None:
        pid = replica["shards"][0]["pid"]
        os.killpg(pid, signal.SIGKILL)
        wait(
            "the engine started again",
            lambda: any(
                r["id"] == replica["id"]
                and r["state"] == "ready"
                and r["shards"][0]["pid"] not in (None, pid)
                for r in self.replicas(replica["model"])
            ),
        )


def scenarios(f: Fleet, load: Callable[[str], None]) -> list[tuple[str, Callable[[], None]]]:
    """The faults, in order; `load(model)` puts a steady client on a model."""

    def drain() -> None:
        f.mark("node-1", "draining", grace_s=60)
        wait("nothing left on node-1", lambda: f.all_settled() and not any(
            s["node"] == "node-1" for m in ("a", "b") for r in f.replicas(m) for s in r["shards"]
        ))  # fmt: skip
        f.mark("node-1", "none")

    def cordons() -> None:
        for _ in range(5):
            f.mark("node-2", "cordoned")
            f.mark("node-2", "none")
        wait("the fleet settled", f.all_settled)

    def roll() -> None:
        before = {r["id"] for r in f.replicas("a")}
        f.apply({**A, "args": ["--itl", "0.006"]}, B)
        wait(
            "a rolled",
            lambda: f.settled("a", 2) and not before & {r["id"] for r in f.replicas("a")},
        )

    def control_plane() -> None:
        f.kill("control-plane")
        wait(
            "the control plane reconciling",
            lambda: f.admin.get("/v1/status").json()["reconcile_passes"] > 2,
        )
        wait("the fleet settled", f.all_settled)

    def agent() -> None:
        f.kill("agent", "node-1")
        wait("the fleet settled", f.all_settled)

    def router() -> None:
        f.kill("router")
        wait("the fleet settled", f.all_settled)

    def one_of_two() -> None:
        f.kill_engine(f.ready("a")[0])

    def only_engine() -> None:
        f.kill_engine(f.ready("b")[0])

    def hung() -> None:
        f.apply({**A, "args": ["--itl", "0.006"]}, B, H)
        [first] = wait("h ready", lambda: f.ready("h"))
        load("h")
        pid = first["shards"][0]["pid"]

        def restarted() -> bool:
            return any(r["shards"][0]["pid"] not in (None, pid) for r in f.ready("h"))

        wait("h found hung and started again", restarted)

    def gpu_fault() -> None:
        [b] = f.ready("b")
        node, [gpu] = b["shards"][0]["node"], b["shards"][0]["gpus"]
        agent_admin = f.running.agent_admin[node]
        headers = {"authorization": f"Bearer {f.running.agent_token}"}
        url = f"{agent_admin}/v1/gpus/{gpu}/health"
        httpx.put(
            url, json={"healthy": False, "reason": "XID 79"}, headers=headers
        ).raise_for_status()
        wait(
            "b moved off the failed GPU",
            lambda: f.settled("b", 1) and f.ready("b")[0]["id"] != b["id"],
        )
        httpx.put(url, json={"healthy": True}, headers=headers).raise_for_status()

    return [
        ("drain", drain),
        ("cordon_x5", cordons),
        ("catalog_roll", roll),
        ("kill_control_plane", control_plane),
        ("kill_agent", agent),
        ("kill_router", router),
        ("kill_one_engine_of_two", one_of_two),
        ("kill_only_engine", only_engine),
        ("hung_engine", hung),
        ("gpu_fault", gpu_fault),
    ]


# The event each fault must leave, naming its cause (`ctl events`).
CAUSES = {
    "drain": ("NodeMarked", "NodeDrained"),
    "cordon_x5": ("NodeMarked",),
    "catalog_roll": ("CatalogApplied",),
    "kill_control_plane": ("ControlPlaneStarted",),
    "kill_agent": ("AgentRestarted",),
    # Said of every restart: a router that restores its table file is often back before a
    # check finds it down (no PushMissed then: events_per_fault was false in one run of two).
    "kill_router": ("RouterRestarted",),
    "kill_one_engine_of_two": ("ShardRestarted",),
    "kill_only_engine": ("ShardRestarted",),
    "hung_engine": ("ShardFailed",),
    "gpu_fault": ("GpuUnhealthy",),
}


def causes_recorded(f: Fleet, name: str, since: float) -> list[str]:
    """Which of the events `name` must leave were recorded from `since` (wall clock) on,
    waiting up to 15 s for the last of them."""
    wanted = CAUSES[name]
    deadline = time.monotonic() + 15
    while True:
        events = f.admin.get("/v1/events", params={"since": "1h"}).json()["events"]
        seen = {e["reason"] for e in events if e["last_at"] >= since}
        found = [r for r in wanted if r in seen]
        if len(found) == len(wanted) or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def run(rate: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state"
        state.mkdir()
        (state / "catalog.yaml").write_text(yaml.safe_dump({"models": [A, B]}))
        options = FleetOptions(
            report_interval=0.5,
            agent_args=("--liveness-interval", "1", "--liveness-failures", "2",
                        "--liveness-timeout", "0.5"),
        )  # fmt: skip
        running = start_fleet(state, options)
        f = Fleet(running)
        clients: list[SteadyClient] = []
        try:
            wait("a and b serving", f.all_settled)

            def load(model: str) -> None:
                client = SteadyClient(running.router_url, running.api_key, model, pace=rate / 2)
                client.start()
                clients.append(client)

            load("a")
            load("b")
            results: dict[str, Any] = {}
            for name, fault in scenarios(f, load):
                began, began_wall = time.monotonic(), time.time()
                fault()
                ended = time.monotonic()
                recorded = causes_recorded(f, name, began_wall - 1)
                sent = failed = 0
                for c in clients:
                    inside = [o for o in c.outcomes if began <= o.ended < ended]
                    sent += len(inside)
                    failed += sum(1 for o in inside if o.error)
                results[name] = {
                    "sent": sent,
                    "failed": failed,
                    "seconds": round(ended - began, 1),
                    "events": recorded,
                    "events_missing": [r for r in CAUSES[name] if r not in recorded],
                }
                print(
                    f"{name:24} {sent:6} requests, {failed:5} failed, {ended - began:5.1f}s, "
                    f"events {', '.join(recorded) or 'NONE'}",
                    flush=True,
                )
        finally:
            for c in clients:
                c.stop()
            running.fleet.stop()
        return results


def main() -> None:
    end_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=20.0, help="requests/s over a and b")
    args = parser.parse_args()
    results = run(args.rate)
    every = all(not r["events_missing"] for r in results.values())
    json_line(
        {"bench": "faults", "rate": args.rate, "scenarios": results, "events_per_fault": every}
    )


if __name__ == "__main__":
    main()
