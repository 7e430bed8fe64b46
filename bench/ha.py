"""Several control planes on one PostgreSQL: what a failover costs, that no stale write lands,
and that the fleet keeps its promises through store outages and a nemesis.

Starts a fleet the way `modelfleet up --control-planes 3 --store postgres` does (a PostgreSQL
of its own, three control planes on it, a router, two agents with simulated GPUs) in a
temporary folder, with model `a` (two replicas), and keeps the official `openai` client on it
at `--rate` requests/s (tests/integration/openai_client.py, each request sent on time, no
retries). Nodes are stale after 5 s and lost after 10 s, so that a leader frozen for the
recipe below holds a view in which they are lost. Then:

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
   it: applied exactly once (`change_during_failover_applied`);
5. the two-host catalog case: a follower given a catalog file of its own (as on another host)
   holding an old catalog, a catalog applied through the API, the follower restarted, then
   the lead failed over to it: the API's catalog stands (`follower_catalog_kept`, target true);
6. a leader frozen past node_lost_after while another leads and retires a replica, the others
   killed -9, the frozen one thawed: it wins the lease again and must adopt what runs
   (`releader_engine_restarts`: engines started or stopped by it, target 0);
7. PostgreSQL frozen (SIGSTOP) 30 s, then stopped 30 s, under load: failed requests
   (`store_outage_failed`, target 0), control planes that exited (`store_outage_exits`,
   target 0), the slowest `ctl status` (with every admin URL) asked every half second
   meanwhile (`store_outage_status_ms`, target <= 1000), and seconds from the server
   answering again until every agent has reported to the leader (`agents_to_leader_s`,
   target <= 5);
7b. PostgreSQL stopped, and while it is down the leader and the next control plane of the
   agents' lists frozen (SIGSTOP: as when their reconnects are spaced out), so that the third
   takes the lease once the server is back: seconds from its return until every agent has
   reported to that one (`agents_to_new_leader_s`, target <= 5), requests that failed
   meanwhile (`store_back_failed`, target 0);
8. a clone of the leader (its state dir copied, seen at the same path through a mount
   namespace of its own: a cloned machine, one host name) started beside it: status samples
   in which both led (`clone_double_lead`, target 0; needs root and unshare);
9. PostgreSQL stopped and started, once per `--store-stops` (seconds; default 40 and 60):
   the most seconds from the server answering again until a change through the admin API
   succeeds (`change_after_store_back_s`, target <= 5), and each;
10. PostgreSQL stalled (SIGSTOP) 2 s, four times, and 25 s once, each time keys made through
    the leader's admin API at once (no retries): `ambiguous_write_lied` (target 0) counts
    the changes answered as refused ("nothing was changed") that are in the store once it
    answers again; `ambiguous_write_unknown` those answered "may have been made" (and of them
    `ambiguous_write_landed`, in the store), `ambiguous_write_untold` keys the store holds
    that the leader does not (its routers lack them; target 0);
11. the nemesis of the test suite (tests/integration/nemesis.py) for `--nemesis-minutes`
   (default 5; 0 skips it) under the seed `--seed` (drawn when not given, printed): kill -9,
   SIGSTOP and SIGCONT of control planes, agents and PostgreSQL, catalog changes, keys made
   and revoked. `nemesis_violations` (target 0) counts the promises it found broken and the
   client requests that failed meanwhile (nothing on the data path is killed).

Ends with one JSON line.

    python bench/ha.py [--rate 20] [--ttl 3] [--nemesis-minutes 5] [--seed N] [--store-stops 40,60]
        [--parts leader_killed,...]   (the parts to run, by the names below; default all)
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
from kit import answered, end_on_sigterm, json_line
from kit import wait as _wait

from modelfleet.ctl.client import AdminClient, AdminTarget, CtlError
from modelfleet.host.files import write_atomic
from modelfleet.up import FleetOptions, RunningFleet, start_fleet
from modelfleet.up.children import Child
from modelfleet.up.fleet import wait_serving

ROOT = Path(__file__).resolve().parent.parent
CLIENT = ROOT / "tests" / "integration" / "openai_client.py"
sys.path.insert(0, str(ROOT))  # the nemesis of the test suite
from tests.integration.nemesis import Nemesis, alive  # noqa: E402

A = {"name": "a", "engine": "sim", "replicas": 2, "args": ["--itl", "0.005"]}


B = {"name": "b", "engine": "sim", "args": ["--itl", "0.005"]}
C = {"name": "c", "engine": "sim", "args": ["--itl", "0.005"]}
NODE_STALE_S, NODE_LOST_S = 5.0, 10.0
OUTAGE_S = 30.0  # PostgreSQL frozen this long, then stopped this long
PARTS = ("leader_killed", "store_restarted", "change_during_failover", "follower_catalog",
         "releader", "store_outage", "store_back_to_another", "clone_double_lead", "store_back",
         "ambiguous_writes", "nemesis")  # fmt: skip


def wait(what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
    return _wait(what, check, timeout, done=answered)  # 0 is an answer: the first plane


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

    def acting(self, among: list[int]) -> int | None:
        """The one of `among` that leads and has made a reconcile pass, or None."""
        for i in among:
            s = self.status(i)
            if s is not None and s["leading"] and s["reconcile_passes"] > 0:
                return i
        return None

    def change(
        self, method: str, path: str, content: bytes, only: int | None = None
    ) -> dict[str, Any] | None:
        """A change sent to one control plane after another (or to `only`), a follower's 307
        followed with the token, as ctl does; the answer of the first that took it."""
        urls = self.running.admin_urls if only is None else [self.running.admin_urls[only]]
        for url in urls:
            try:
                answer = self.http.request(method, url + path, content=content)
                if answer.status_code == 307:
                    answer = self.http.request(method, answer.headers["location"], content=content)
            except httpx.HTTPError:
                continue
            if answer.status_code == 200:
                taken: dict[str, Any] = answer.json()
                return taken
        return None

    def apply(self, models: list[dict[str, Any]], only: int | None = None) -> dict[str, Any] | None:
        return self.change("PUT", "/v1/catalog", yaml.safe_dump({"models": models}).encode(), only)

    def kill(self, i: int) -> None:
        os.killpg(self.children[i].proc.pid, signal.SIGKILL)
        self.children[i].proc.wait()


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


class Bench:
    """One run: the fleet, its control planes, the client's record and the figures so far."""

    def __init__(self, running: RunningFleet, state: Path, out: Path, ttl: float) -> None:
        self.running = running
        self.planes = Planes(running)
        self.state = state
        self.out = out  # the client's requests, a JSON line each
        self.ttl = ttl
        self.results: dict[str, Any] = {}

    def serving(self, models: list[dict[str, Any]], what: str, timeout: float = 60) -> None:
        wait(what, lambda: wait_serving(self.running.push_url, self.running.admin_token,
                                        _catalog_of(models), 1), timeout)  # fmt: skip

    def engines(self) -> set[int]:
        """The engines running now."""
        recorded = self.running.fleet.engine_pids().values()
        return {pid for pids in recorded for pid in pids if alive(pid)}

    def child(self, role: str) -> Child:
        return next(c for c in self.running.fleet.children if c.role == role)


def leader_killed(bench: Bench) -> int:
    """1. kill -9 of the leader; returns the control plane that leads after."""
    planes, r = bench.planes, bench.results
    leader = wait("a leader", planes.leader, 30)
    engines = bench.running.fleet.engine_pids()
    start = time.time()
    t0 = time.monotonic()
    planes.kill(leader)
    others = [i for i in range(len(planes.children)) if i != leader]
    now_leads: int = wait("another leader's first pass", lambda: planes.acting(others), 60)
    r["leader_kill_takeover_s"] = round(time.monotonic() - t0, 2)
    time.sleep(2)  # requests sent during the takeover end
    r["leader_kill_requests"], r["leader_kill_failed"] = failed_between(
        bench.out, start, time.time()
    )
    after = bench.running.fleet.engine_pids()
    before_set = {p for pids in engines.values() for p in pids}
    after_set = {p for pids in after.values() for p in pids}
    r["leader_kill_engine_restarts"] = len(before_set - after_set)
    bench.running.fleet.restart(planes.children[leader])  # back, as a follower
    return now_leads


def leader_frozen(bench: Bench, frozen: int) -> None:
    """2. the leader frozen for twice the TTL, a change made meanwhile through a follower."""
    planes, r, ttl = bench.planes, bench.results, bench.ttl
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
    r["frozen_change_taken"] = bool(
        wait("the change through a follower", lambda: planes.apply([A, B], only=follower), 30)
    )
    time.sleep(max(0.0, 2 * ttl - (time.monotonic() - stopped_at)))
    os.kill(planes.children[frozen].proc.pid, signal.SIGCONT)
    resumed = time.time()
    bench.serving([A, B], "b serving")
    time.sleep(2 * ttl)  # what the old leader had under way has landed or been refused
    with psycopg.connect(_conninfo(bench.state)) as conn:
        events = conn.execute(
            "SELECT reason, message FROM events WHERE source = %s AND last_at >= %s "
            "AND reason <> 'LeadershipLost'",
            (f"control-plane {holder}", resumed),
        ).fetchall()
        catalogs = conn.execute(
            "SELECT version FROM catalogs WHERE applied_at >= %s", (resumed,)
        ).fetchall()
    logs = bench.state / "logs"
    agent_back = sum(
        epochs_going_back(p, r"assignment \S+ of epoch (\d+)") for p in logs.glob("agent-*")
    )
    router_back = epochs_going_back(logs / "router.log", r"took a table of routing epoch (\d+)")
    refused = sum(p.read_text(errors="replace").count("refused an assignment")
                  for p in logs.glob("agent-*"))  # fmt: skip
    r["frozen_leader_stale_writes"] = len(events) + len(catalogs) + agent_back + router_back
    r["frozen_leader_stale_detail"] = {
        "store_events": [list(e) for e in events],
        "store_catalogs": len(catalogs),
        "agent_assignments_of_an_older_epoch": agent_back,
        "router_tables_of_an_older_epoch": router_back,
        "refused_by_agents": refused,
    }
    r["frozen_leader_leads_after"] = bool((planes.status(frozen) or {}).get("leading"))


def a_change_lands(planes: Planes) -> bool:
    """A mark set and cleared again through the admin API, wherever it is taken."""
    path = "/v1/nodes/node-2/mark"
    if planes.change("POST", path, b'{"mark": "cordoned"}') is None:
        return False
    return planes.change("POST", path, b'{"mark": "none"}') is not None


def store_restarted(bench: Bench) -> None:
    """3. PostgreSQL restarted (fast shutdown) under load."""
    pg, r = bench.child("postgres"), bench.results
    start = time.time()
    os.killpg(pg.proc.pid, signal.SIGINT)  # fast shutdown: clients are cut
    pg.proc.wait(60)
    bench.running.fleet.restart(pg, timeout=60)
    back = time.monotonic()
    wait("a change after the store restarted", lambda: a_change_lands(bench.planes), 60)
    r["store_restart_recovered_s"] = round(time.monotonic() - back, 2)
    time.sleep(2)
    r["store_restart_requests"], r["store_restart_failed"] = failed_between(
        bench.out, start, time.time()
    )


def change_during_failover(bench: Bench) -> None:
    """4. kill -9 of the leader and at once a catalog change: applied exactly once."""
    planes, r = bench.planes, bench.results
    leader = wait("a leader", planes.leader, 30)
    planes.kill(leader)
    rest = [i for i in range(len(planes.children)) if i != leader]
    tries = 0

    def applied() -> bool:
        nonlocal tries
        tries += 1
        return any(planes.apply([A, B, C], only=i) for i in rest)

    wait("the change taken during the failover", applied, 60)
    bench.serving([A, B, C], "c serving")
    history = planes.http.get(f"{bench.running.admin_urls[rest[0]]}/v1/catalog/history").json()
    with_c = [v for v in history["versions"] if "c" in v["models"]]
    r["change_during_failover_tries"] = tries
    r["change_during_failover_applied"] = len(with_c) == 1
    bench.running.fleet.restart(planes.children[leader])


def follower_catalog(bench: Bench) -> None:
    """5. A follower with a catalog file of its own, restarted after an API apply, then
    leading: the API's catalog stands."""
    planes, r = bench.planes, bench.results
    leader = wait("a leader", planes.leader, 30)
    follower, third = [i for i in range(len(planes.children)) if i != leader]
    child = planes.children[follower]
    config_file = bench.state / f"{child.label}.yaml"
    shared = config_file.read_text()
    own = bench.state / f"{child.label}-own-catalog.yaml"
    own.write_text("# the file on the follower's host\n" + yaml.safe_dump({"models": [A]}))
    config_file.write_text(yaml.safe_dump({**yaml.safe_load(shared), "catalog": str(own)}))
    try:
        applied = wait("the API apply", lambda: planes.apply([A, B], only=leader), 30)
        bench.running.fleet.restart(child, timeout=30)
        third_pid = planes.children[third].proc.pid
        os.killpg(third_pid, signal.SIGSTOP)  # the lead can only go to the follower
        try:
            planes.kill(leader)
            wait("the restarted follower leading", lambda: planes.acting([follower]), 30)
            shown = planes.http.get(f"{bench.running.admin_urls[follower]}/v1/catalog").json()
        finally:
            os.killpg(third_pid, signal.SIGCONT)
        names = [m["name"] for m in shown["models"]]
        r["follower_catalog_kept"] = shown["version"] == applied["version"] and names == ["a", "b"]
        r["follower_catalog_detail"] = {"applied": applied["version"], "shown": shown["version"],
                                        "models": names, "source": shown.get("source")}  # fmt: skip
        bench.serving([A, B], "a and b serving under the follower")
    finally:
        config_file.write_text(shared)  # its next start, in the nemesis, as `up` made it
    bench.running.fleet.restart(planes.children[leader])


def releader(bench: Bench) -> None:
    """6. The leader frozen past node_lost_after while another leads and retires a replica;
    the others killed -9; the frozen one thawed wins the lease again: what does it restart?"""
    planes, r = bench.planes, bench.results
    frozen = wait("a leader", planes.leader, 30)
    was = (planes.status(frozen) or {}).get("lease_epoch", 0)
    others = [i for i in range(len(planes.children)) if i != frozen]
    pid = planes.children[frozen].proc.pid
    os.killpg(pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        successor = wait("another leader's first pass", lambda: planes.acting(others), 30)
        wait("the API apply", lambda: planes.apply([{**A, "replicas": 1}, B], only=successor), 30)
        wait("one replica of a retired", lambda: len(bench.engines()) == 2, 60)
        wait("the frozen leader's view past node_lost_after",
             lambda: time.monotonic() - frozen_at > NODE_LOST_S + 2, NODE_LOST_S + 60)  # fmt: skip
    finally:
        before = bench.engines()
        for i in others:
            planes.kill(i)
        os.killpg(pid, signal.SIGCONT)
    thawed = time.monotonic()
    again = wait("the thawed one leading again, under a new epoch",
                 lambda: (s := planes.status(frozen)) and s["leading"]
                 and s["lease_epoch"] > was and s["reconcile_plans"] >= 1 and s, 60)  # fmt: skip
    r["releader_took_s"] = round(time.monotonic() - thawed, 2)
    bench.serving([{**A, "replicas": 1}, B], "a and b serving under the thawed leader")
    after = bench.engines()
    r["releader_engine_restarts"] = len(before ^ after)
    events = planes.http.get(f"{bench.running.admin_urls[frozen]}/v1/events",
                             params={"limit": 1000}).json()["events"]  # fmt: skip
    elected = max(e["id"] for e in events if e["reason"] == "LeaderElected"
                  and f"epoch {again['lease_epoch']}" in e["message"])  # fmt: skip
    bad = {"NodeLost", "NodeStale", "ReplicaPlaced", "ReplicaRetiring", "ReplicaStopped"}
    r["releader_actions"] = [f"{e['reason']} {e['regarding']}" for e in events
                             if e["id"] > elected and e["reason"] in bad]  # fmt: skip
    for i in others:
        bench.running.fleet.restart(planes.children[i])


def store_outage(bench: Bench) -> None:
    """7. PostgreSQL frozen, then stopped, under load: nothing fails, nothing exits, and
    `ctl status` answers within a second all along."""
    pg, r = bench.child("postgres"), bench.results
    target = AdminTarget(",".join(bench.running.admin_urls), bench.running.admin_token)
    worst, unanswered = 0.0, 0
    planes = [c for c in bench.running.fleet.children if c.role == "control-plane"]
    runs = {c.label: c.proc.pid for c in planes}

    def sample(seconds: float) -> None:
        nonlocal worst, unanswered
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            began = time.monotonic()
            try:
                AdminClient(target).status()
            except CtlError:
                unanswered += 1
            worst = max(worst, time.monotonic() - began)
            time.sleep(0.5)

    start = time.time()
    os.killpg(pg.proc.pid, signal.SIGSTOP)  # the server and every session of it
    try:
        sample(OUTAGE_S)
    finally:
        os.killpg(pg.proc.pid, signal.SIGCONT)
    os.killpg(pg.proc.pid, signal.SIGINT)  # fast shutdown
    pg.proc.wait(60)
    sample(OUTAGE_S)
    bench.running.fleet.restart(pg, timeout=60)
    back = time.monotonic()
    r["store_outage_exits"] = sum(1 for c in planes if c.proc.poll() is not None
                                  or c.proc.pid != runs[c.label])  # fmt: skip

    def at_leader() -> bool:
        """Every agent has reported to the term the leader began when the store came back."""
        leader = bench.planes.leader()
        return leader is not None and agents_at(bench, leader)

    # Each figure from the server's return, the two looked for together.
    def change() -> bool:
        return a_change_lands(bench.planes)

    checks: dict[str, Callable[[], bool]] = {
        "agents_to_leader_s": at_leader, "store_outage_recovered_s": change}  # fmt: skip

    def both() -> bool:
        for figure, check in checks.items():
            if figure not in r and check():
                r[figure] = round(time.monotonic() - back, 2)
        return all(figure in r for figure in checks)

    wait("every agent at the leader, and a change, after the outage", both, 60)
    time.sleep(2)
    r["store_outage_requests"], r["store_outage_failed"] = failed_between(
        bench.out, start, time.time()
    )
    r["store_outage_status_ms"] = round(worst * 1000)
    r["store_outage_status_unanswered"] = unanswered


def clone_double_lead(bench: Bench, samples: int = 20) -> None:
    """8. A clone of the leader beside it: status samples in which both led."""
    r = bench.results
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        r["clone_double_lead"] = None
        r["clone_skipped"] = "a mount namespace of its own needs root and util-linux's unshare"
        return
    planes = bench.planes
    leader = wait("a leader", planes.leader, 30)
    args = planes.children[leader].args
    config = yaml.safe_load(Path(args[args.index("--config") + 1]).read_text())
    state = Path(config["state_dir"]).resolve()
    copy, ready = bench.state / "clone", bench.state / "clone.json"
    shutil.copytree(state, copy, ignore=shutil.ignore_patterns("lock"))
    clone_config = {**config, "state_dir": str(state), "admin_port": 0, "agent_port": 0}
    write_atomic(bench.state / "clone.yaml", yaml.safe_dump(clone_config))  # 0600: secrets
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    with (bench.state / "logs" / "clone.log").open("ab") as out:
        clone = subprocess.Popen(
            ["unshare", "-m", "sh", "-c", script, "sh", str(copy), str(state), sys.executable,
             "-m", "modelfleet", "control-plane", "--config", str(bench.state / "clone.yaml"),
             "--ready-file", str(ready)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    try:
        wait("the clone ready", lambda: ready.exists() or clone.poll() is not None, 60)
        if not ready.exists():
            raise RuntimeError(f"the clone exited ({clone.returncode}): see logs/clone.log")
        url = json.loads(ready.read_text())["urls"]["admin"]
        both, seen = 0, None
        for _ in range(samples):  # over several renewals (a third of the TTL each)
            theirs = planes.status(leader) or {}
            try:
                seen = planes.http.get(f"{url}/v1/status").json()
            except httpx.HTTPError:
                seen = None
            both += bool(theirs.get("leading") and (seen or {}).get("leading"))
            time.sleep(bench.ttl / 6)
        r["clone_double_lead"] = both
        r["clone_samples"] = samples
        r["clone_refused"] = (seen or {}).get("lease_refused", "")
    finally:
        if clone.poll() is None:
            os.killpg(clone.pid, signal.SIGKILL)
        clone.wait()


def store_back(bench: Bench, stops: list[float]) -> None:
    """9. PostgreSQL stopped for each of `stops` seconds and started: until a change lands,
    the slowest. Where a stop ends in the pool's old reconnect schedule (tries 1, 3, 7, 15,
    31, 63 s after it failed) decided what it cost: 17 s after a stop of 40 s, 3.5-4.4 s
    after one of 60 s, measured before the cap."""
    pg, r = bench.child("postgres"), bench.results
    took = {}
    for stopped_s in stops:
        os.killpg(pg.proc.pid, signal.SIGINT)  # fast shutdown: clients are cut
        pg.proc.wait(60)
        time.sleep(stopped_s)
        bench.running.fleet.restart(pg, timeout=60)
        back = time.monotonic()
        wait("a change after the store came back", lambda: a_change_lands(bench.planes), 120)
        took[f"{stopped_s:g}"] = round(time.monotonic() - back, 2)
    r["change_after_store_back_s"] = max(took.values())
    r["change_after_store_back_by_stop_s"] = took


def ambiguous_writes(bench: Bench, stalls: tuple[float, ...] = (2, 2, 2, 2, 25)) -> None:
    """10. Keys made while PostgreSQL stalls: none answered as refused lands, and the leader
    holds every key the store does."""
    planes, r = bench.planes, bench.results
    answers: dict[str, str] = {}  # key name -> "made", "unknown" or "refused"
    for round_, stall in enumerate(stalls):
        wait("a change before the stall", lambda: a_change_lands(planes), 60)
        leader = wait("a leader", planes.leader, 30)
        url = bench.running.admin_urls[leader]
        pids = _pg_server(bench.state).pids()  # the server and every session of it
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        stalled_at = time.monotonic()
        try:
            for i in range(3):
                name = f"stalled-{round_}-{i}"
                try:
                    answer = planes.http.post(f"{url}/v1/keys", json={"name": name})
                except httpx.HTTPError:
                    answers[name] = "unknown"  # sent, and no answer: it may have been made
                    continue
                body = answer.json() if answer.content else {}
                answers[name] = (
                    "made"
                    if answer.status_code == 200
                    else "unknown"
                    if body.get("may_have_been_made")
                    else "refused"
                )
            while time.monotonic() - stalled_at < stall:
                time.sleep(0.1)
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
    wait("a change after the stalls", lambda: a_change_lands(planes), 60)
    time.sleep(3)  # what lands late, lands within the store's bounds
    stored = set(_stored_keys(bench.state))
    leader = wait("a leader", planes.leader, 30)
    held = {k["name"] for k in planes.http.get(
        f"{bench.running.admin_urls[leader]}/v1/keys").json()["keys"]}  # fmt: skip
    print("ambiguous writes:", json.dumps(answers), file=sys.stderr)
    r["ambiguous_write_changes"] = len(answers)
    r["ambiguous_write_refused"] = sum(1 for a in answers.values() if a == "refused")
    r["ambiguous_write_unknown"] = sum(1 for a in answers.values() if a == "unknown")
    r["ambiguous_write_landed"] = sum(
        1 for n, a in answers.items() if a == "unknown" and n in stored
    )
    r["ambiguous_write_lied"] = sum(1 for n, a in answers.items() if a == "refused" and n in stored)
    r["ambiguous_write_untold"] = len({n for n in stored if n.startswith("stalled-")} - held)


def _stored_keys(state: Path) -> list[str]:
    """The names of the keys in the fleet's PostgreSQL, read from it directly."""
    import psycopg

    with psycopg.connect(_conninfo(state)) as conn:
        return [row[0] for row in conn.execute("SELECT name FROM api_keys")]


def agents_at(bench: Bench, i: int) -> bool:
    """Control plane `i` leads, and every agent has reported to the term it leads."""
    agents = sum(1 for c in bench.running.fleet.children if c.role == "agent")
    status = bench.planes.status(i)
    return status is not None and status["leading"] and status["nodes"] >= agents


def store_back_to_another(bench: Bench) -> None:
    """7b. The store back while the leader and the next control plane are frozen: the third
    leads, and the agents must find it (issue 57: they bounced between two stale ones)."""
    pg, planes, r = bench.child("postgres"), bench.planes, bench.results
    leader = wait("a leader", planes.leader, 30)
    count = len(planes.children)
    frozen = [leader, (leader + 1) % count]
    [third] = [i for i in range(count) if i not in frozen]
    start = time.time()
    os.killpg(pg.proc.pid, signal.SIGINT)  # fast shutdown
    pg.proc.wait(60)
    wait(
        "the leader no longer acting",
        lambda: (planes.status(leader) or {}).get("leading") is False,
        30,
    )
    for i in frozen:
        os.kill(planes.children[i].proc.pid, signal.SIGSTOP)
    try:
        bench.running.fleet.restart(pg, timeout=60)
        back = time.monotonic()
        wait("every agent at the third control plane", lambda: agents_at(bench, third), 60)
        r["agents_to_new_leader_s"] = round(time.monotonic() - back, 2)
    finally:
        for i in frozen:
            os.kill(planes.children[i].proc.pid, signal.SIGCONT)
    time.sleep(2)
    r["store_back_requests"], r["store_back_failed"] = failed_between(bench.out, start, time.time())


def nemesis(bench: Bench, minutes: float, seed: int) -> None:
    """11. The nemesis for `minutes`, under `seed`."""
    r = bench.results
    r["nemesis_seed"], r["nemesis_minutes"] = seed, minutes
    if minutes <= 0:
        return
    wait("the nemesis's catalog", lambda: bench.planes.apply([A]), 30)
    start = time.time()
    chaos = Nemesis(bench.running, seed)
    chaos.run(minutes * 60)
    violations = chaos.check()
    total, failed = failed_between(bench.out, start, time.time())
    r["nemesis_actions"] = len(chaos.done)
    r["nemesis_requests"], r["nemesis_failed"] = total, failed
    r["nemesis_violations"] = len(violations) + failed
    r["nemesis_detail"] = violations[:20]
    if violations or failed:
        print(f"nemesis schedule (seed {seed}):", *chaos.done, sep="\n", file=sys.stderr)


def main() -> None:
    end_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--ttl", type=float, default=3.0, help="the lease's TTL, seconds")
    parser.add_argument("--nemesis-minutes", type=float, default=5.0, help="0: no nemesis")
    parser.add_argument("--seed", type=int, default=None, help="the nemesis's (drawn if not given)")
    parser.add_argument("--store-stops", default="40,60", help="seconds, part 9: each stop")
    parser.add_argument("--parts", default="", help="the parts to run, by name; default all")
    args = parser.parse_args()
    chosen = [p for p in args.parts.split(",") if p] or list(PARTS)
    unknown = sorted(set(chosen) - set(PARTS))
    if unknown:
        parser.error(f"no part {', '.join(unknown)}; the parts: {', '.join(PARTS)}")
    stops = [float(x) for x in args.store_stops.split(",")]
    seed = args.seed if args.seed is not None else random.randrange(10**6)

    folder = Path(tempfile.mkdtemp(prefix="modelfleet-ha-"))
    os.chmod(folder, 0o711)  # run as root, the PostgreSQL server runs as `postgres`: it enters
    state = folder / "fleet"
    state.mkdir(mode=0o700)
    (state / "catalog.yaml").write_text(yaml.safe_dump({"models": [A]}))
    options = FleetOptions(
        control_planes=3,
        store="postgres",
        report_interval=1.0,
        control_plane={"lease_ttl": args.ttl, "settle_for": 10,
                       "node_stale_after": NODE_STALE_S, "node_lost_after": NODE_LOST_S},
    )  # fmt: skip
    running = start_fleet(state, options)
    stop, out = folder / "stop", folder / "requests.jsonl"
    bench = Bench(running, state, out, args.ttl)
    bench.results.update({"lease_ttl_s": args.ttl, "rate": args.rate})
    load: subprocess.Popen[bytes] | None = None
    try:
        bench.serving([A], "a serving")
        load = subprocess.Popen(
            [sys.executable, str(CLIENT), running.router_url + "/v1", "-", running.api_key, "a",
             "load", str(args.rate), str(stop), str(out)],
        )  # fmt: skip
        wait("the first requests", lambda: out.exists() and out.stat().st_size > 0, 30)
        parts: dict[str, Callable[[], None]] = {
            "leader_killed": lambda: leader_frozen(bench, leader_killed(bench)),
            "store_restarted": lambda: store_restarted(bench),
            "change_during_failover": lambda: change_during_failover(bench),
            "follower_catalog": lambda: follower_catalog(bench),
            "releader": lambda: releader(bench),
            "store_outage": lambda: store_outage(bench),
            "clone_double_lead": lambda: clone_double_lead(bench),
            "store_back": lambda: store_back(bench, stops),
            "store_back_to_another": lambda: store_back_to_another(bench),
            "ambiguous_writes": lambda: ambiguous_writes(bench),
            "nemesis": lambda: nemesis(bench, args.nemesis_minutes, seed),
        }
        assert set(parts) == set(PARTS)
        for name in PARTS:
            if name in chosen:
                parts[name]()
    except BaseException:
        print(f"failed: the fleet's folder is kept, {folder}; so far: {json.dumps(bench.results)}",
              file=sys.stderr)  # fmt: skip
        raise
    finally:
        stop.touch()
        if load is not None:
            load.wait(60)
        running.fleet.stop()
    shutil.rmtree(folder)  # kept when the run failed: its logs say why
    json_line(bench.results)


def _catalog_of(models: list[dict[str, Any]]) -> Any:
    from modelfleet.core.catalog import Catalog

    return Catalog.from_yaml(yaml.safe_dump({"models": models}))


def _pg_server(state: Path) -> Any:
    from modelfleet.host.pgserver import PgServer

    kept = json.loads((state / "up-kept.json").read_text())
    return PgServer(state / "postgres", kept["postgres_port"])


def _conninfo(state: Path) -> str:
    conninfo: str = _pg_server(state).conninfo()
    return conninfo


if __name__ == "__main__":
    main()
