"""Several control planes on one PostgreSQL: what a failover costs, and that no stale write lands.

Starts a fleet the way `modelfleet up --control-planes 3 --store postgres` does (a PostgreSQL
of its own, three control planes on it, a router, two agents with simulated GPUs) in a
temporary folder, with model `a` (two replicas), and keeps the official `openai` client on it
at `--rate` requests/s (tests/integration/openai_client.py, each request sent on time, no
retries). Then:

1. kill -9 of the leader: seconds until another leads and has made a reconcile pass
   (`leader_kill_takeover_s`; target <= lease TTL + one renewal, 4 s at the default TTL of
   3 s), client requests that failed meanwhile, engines restarted (both targets 0);
2. the leader frozen (SIGSTOP) for twice the TTL; once another leads, a catalog change is
   sent to a follower (which redirects it to the new leader); SIGCONT. Writes of the old
   leader that landed afterwards (`frozen_leader_stale_writes`, target 0): its events in the
   store after SIGCONT (but for its own LeadershipLost), catalogs written after SIGCONT, and
   assignments or routing tables of an older epoch than one taken before them, read from the
   agents' and the router's logs;
3. PostgreSQL stopped (fast shutdown) and started again under load: failed requests (target
   0) and seconds from the server answering again until a change through the admin API
   succeeds (`store_restart_recovered_s`);
4. kill -9 of the leader and at once a catalog change, sent to whichever control plane takes
   it: applied exactly once (`change_during_failover_applied`).

Ends with one JSON line.

    python bench/ha.py [--rate 20] [--ttl 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psycopg
import yaml

from modelfleet.up import FleetOptions, RunningFleet, start_fleet
from modelfleet.up.fleet import wait_serving

ROOT = Path(__file__).resolve().parent.parent
CLIENT = ROOT / "tests" / "integration" / "openai_client.py"
A = {"name": "a", "engine": "sim", "replicas": 2, "args": ["--itl", "0.005"]}


def wait(what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result is not None and result is not False:  # 0 is an answer: the first plane
            return result
        time.sleep(0.05)
    raise RuntimeError(f"timed out after {timeout}s waiting for {what}")


class Planes:
    """The control planes of the fleet as an operator reaches them."""

    def __init__(self, running: RunningFleet) -> None:
        self.running = running
        self.headers = {"authorization": f"Bearer {running.admin_token}"}
        self.http = httpx.Client(headers=self.headers, timeout=3)
        self.children = [c for c in running.fleet.children if c.role == "control-plane"]

    def status(self, i: int) -> dict[str, Any] | None:
        try:
            answer = self.http.get(f"{self.running.admin_urls[i]}/v1/status")
        except httpx.HTTPError:
            return None
        return answer.json() if answer.status_code == 200 else None

    def leader(self) -> int | None:
        for i in range(len(self.children)):
            s = self.status(i)
            if s is not None and s["leading"]:
                return i
        return None

    def change(self, method: str, path: str, content: bytes, only: int | None = None) -> bool:
        """A change sent to one control plane after another (or to `only`), a follower's 307
        followed with the token, as ctl does; True once one took it."""
        urls = self.running.admin_urls if only is None else [self.running.admin_urls[only]]
        for url in urls:
            try:
                answer = self.http.request(method, url + path, content=content)
                if answer.status_code == 307:
                    answer = self.http.request(method, answer.headers["location"], content=content)
            except httpx.HTTPError:
                continue
            if answer.status_code == 200:
                return True
        return False

    def apply(self, models: list[dict[str, Any]], only: int | None = None) -> bool:
        return self.change("PUT", "/v1/catalog", yaml.safe_dump({"models": models}).encode(), only)


def failed_between(out: Path, start: float, end: float) -> tuple[int, int]:
    """Requests that ended in [start, end] (wall clock), and how many of them failed."""
    rows = [json.loads(line) for line in out.read_text().splitlines() if line]
    inside = [r for r in rows if start <= r["end"] <= end]
    return len(inside), sum(1 for r in inside if r["error"])


def epochs_going_back(log: Path, pattern: str) -> int:
    """Lines of `log` that took something of an epoch lower than one taken before them."""
    highest, back = 0, 0
    for match in re.finditer(pattern, log.read_text(errors="replace")):
        epoch = int(match.group(1))
        back += epoch < highest
        highest = max(highest, epoch)
    return back


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--ttl", type=float, default=3.0, help="the lease's TTL, seconds")
    args = parser.parse_args()
    ttl = args.ttl

    folder = Path(tempfile.mkdtemp(prefix="modelfleet-ha-"))
    os.chmod(folder, 0o711)  # run as root, the PostgreSQL server runs as `postgres`: it enters
    state = folder / "fleet"
    state.mkdir(mode=0o700)
    (state / "catalog.yaml").write_text(yaml.safe_dump({"models": [A]}))
    options = FleetOptions(
        control_planes=3,
        store="postgres",
        report_interval=1.0,
        control_plane={"lease_ttl": ttl, "settle_for": 10},
    )
    running = start_fleet(state, options)
    results: dict[str, Any] = {"lease_ttl_s": ttl, "rate": args.rate}
    load: subprocess.Popen[bytes] | None = None
    try:
        wait("a serving", lambda: wait_serving(running.push_url, running.admin_token,
                                               _catalog(state), 1), 60)  # fmt: skip
        planes = Planes(running)
        stop, out = folder / "stop", folder / "requests.jsonl"
        load = subprocess.Popen(
            [sys.executable, str(CLIENT), running.router_url + "/v1", "-", running.api_key, "a",
             "load", str(args.rate), str(stop), str(out)],
        )  # fmt: skip
        wait("the first requests", lambda: out.exists() and out.stat().st_size > 0, 30)

        # 1. kill -9 of the leader
        leader = wait("a leader", planes.leader, 30)
        engines = running.fleet.engine_pids()
        start = time.time()
        t0 = time.monotonic()
        os.kill(planes.children[leader].proc.pid, signal.SIGKILL)
        planes.children[leader].proc.wait()

        def new_leader_passed() -> int | None:
            for i in range(len(planes.children)):
                s = planes.status(i) if i != leader else None
                if s is not None and s["leading"] and s["reconcile_passes"] > 0:
                    return i
            return None

        now_leads = wait("another leader's first pass", new_leader_passed, 60)
        results["leader_kill_takeover_s"] = round(time.monotonic() - t0, 2)
        time.sleep(2)  # requests sent during the takeover end
        total, failed = failed_between(out, start, time.time())
        results["leader_kill_requests"] = total
        results["leader_kill_failed"] = failed
        after = running.fleet.engine_pids()
        before_set = {p for pids in engines.values() for p in pids}
        after_set = {p for pids in after.values() for p in pids}
        results["leader_kill_engine_restarts"] = len(before_set - after_set)
        running.fleet.restart(planes.children[leader])  # back, as a follower

        # 2. the leader frozen for twice the TTL, a change made meanwhile through a follower
        frozen = now_leads
        frozen_status = planes.status(frozen)
        assert frozen_status is not None
        holder = next(p["name"] for p in frozen_status["control_planes"] if p["answering"])
        os.kill(planes.children[frozen].proc.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        others = [i for i in range(len(planes.children)) if i != frozen]
        successor = wait("a leader besides the frozen one",
                         lambda: next((i for i in others if (planes.status(i) or {}).get(
                             "leading")), None), 30)  # fmt: skip
        follower = next(i for i in others if i != successor)
        b = {"name": "b", "engine": "sim", "args": ["--itl", "0.005"]}
        results["frozen_change_taken"] = wait(
            "the change through a follower", lambda: planes.apply([A, b], only=follower), 30
        )
        time.sleep(max(0.0, 2 * ttl - (time.monotonic() - stopped_at)))
        os.kill(planes.children[frozen].proc.pid, signal.SIGCONT)
        resumed = time.time()
        wait("b serving", lambda: wait_serving(running.push_url, running.admin_token,
                                               _catalog_of([A, b]), 1), 60)  # fmt: skip
        time.sleep(2 * ttl)  # what the old leader had under way has landed or been refused
        with psycopg.connect(_conninfo(state)) as conn:
            events = conn.execute(
                "SELECT reason, message FROM events WHERE source = %s AND last_at >= %s "
                "AND reason <> 'LeadershipLost'",
                (f"control-plane {holder}", resumed),
            ).fetchall()
            catalogs = conn.execute(
                "SELECT version FROM catalogs WHERE applied_at >= %s", (resumed,)
            ).fetchall()
        logs = state / "logs"
        agent_back = sum(
            epochs_going_back(p, r"assignment \S+ of epoch (\d+)") for p in logs.glob("agent-*")
        )
        router_back = epochs_going_back(logs / "router.log", r"took a table of routing epoch (\d+)")
        refused = sum(p.read_text(errors="replace").count("refused an assignment")
                      for p in logs.glob("agent-*"))  # fmt: skip
        results["frozen_leader_stale_writes"] = (
            len(events) + len(catalogs) + agent_back + router_back
        )
        results["frozen_leader_stale_detail"] = {
            "store_events": [list(e) for e in events],
            "store_catalogs": len(catalogs),
            "agent_assignments_of_an_older_epoch": agent_back,
            "router_tables_of_an_older_epoch": router_back,
            "refused_by_agents": refused,
        }
        frozen_now = planes.status(frozen) or {}
        results["frozen_leader_leads_after"] = bool(frozen_now.get("leading"))

        # 3. PostgreSQL restarted under load
        pg = next(c for c in running.fleet.children if c.role == "postgres")
        start = time.time()
        os.killpg(pg.proc.pid, signal.SIGINT)  # fast shutdown: clients are cut
        pg.proc.wait()
        running.fleet.restart(pg, timeout=60)
        back = time.monotonic()

        def a_change_lands() -> bool:
            return planes.change("POST", "/v1/nodes/node-2/mark", b'{"mark": "cordoned"}')

        wait("a change after the store restarted", a_change_lands, 60)
        results["store_restart_recovered_s"] = round(time.monotonic() - back, 2)
        planes.change("POST", "/v1/nodes/node-2/mark", b'{"mark": "none"}')
        time.sleep(2)
        total, failed = failed_between(out, start, time.time())
        results["store_restart_requests"] = total
        results["store_restart_failed"] = failed

        # 4. a change during a failover
        leader = wait("a leader", planes.leader, 30)
        c = {"name": "c", "engine": "sim", "args": ["--itl", "0.005"]}
        os.kill(planes.children[leader].proc.pid, signal.SIGKILL)
        planes.children[leader].proc.wait()
        rest = [i for i in range(len(planes.children)) if i != leader]
        tries = 0

        def applied() -> bool:
            nonlocal tries
            tries += 1
            return any(planes.apply([A, b, c], only=i) for i in rest)

        wait("the change taken during the failover", applied, 60)
        wait("c serving", lambda: wait_serving(running.push_url, running.admin_token,
                                               _catalog_of([A, b, c]), 1), 60)  # fmt: skip
        history = planes.http.get(f"{running.admin_urls[rest[0]]}/v1/catalog/history").json()
        with_c = [v for v in history["versions"] if "c" in v["models"]]
        results["change_during_failover_tries"] = tries
        results["change_during_failover_applied"] = len(with_c) == 1
    finally:
        (folder / "stop").touch()
        if load is not None:
            load.wait(60)
        running.fleet.stop()
    shutil.rmtree(folder)  # kept when the run failed: its logs say why
    print(json.dumps(results))


def _catalog(state: Path) -> Any:
    from modelfleet.catalog import Catalog

    return Catalog.from_yaml((state / "catalog.yaml").read_text())


def _catalog_of(models: list[dict[str, Any]]) -> Any:
    from modelfleet.catalog import Catalog

    return Catalog.from_yaml(yaml.safe_dump({"models": models}))


def _conninfo(state: Path) -> str:
    from modelfleet.pgserver import PgServer

    kept = json.loads((state / "up-kept.json").read_text())
    conninfo: str = PgServer(state / "postgres", kept["postgres_port"]).conninfo()
    return conninfo


if __name__ == "__main__":
    main()
