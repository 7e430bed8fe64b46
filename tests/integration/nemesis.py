"""A nemesis, after Jepsen's: a seeded random schedule of faults against a running fleet of
several control planes on one PostgreSQL, changes made through the admin API meanwhile, and
the checks that the fleet kept its promises through all of it.

Faults: kill -9 of a control plane or an agent (started again a moment later), SIGSTOP of a
control plane or of PostgreSQL (SIGCONT a moment later), kill -9 of PostgreSQL (started again,
crash recovery). Changes: catalogs (model `e` added or removed, `a` scaled between 2 and 3),
API keys made and revoked. Clients send requests to model `a` all along (the caller does).

At the end everything is let go and started again, and `check` finds the violations:
- an acknowledged write that is not in the store (a key made and answered 200 that is not
  listed, a key revoked and answered 200 that is, a catalog version answered that is not in
  the history, a current catalog that is neither the last acknowledged one nor one asked
  after it);
- engines that do not match the catalog once the fleet settles (an endpoint missing at the
  router, or more engines running than the catalog has shards);
- two control planes that led under one epoch (from their logs: "leading under epoch N").

`python bench/ha.py` runs it for minutes; tests/integration/test_nemesis.py for one, under
a fixed seed. The seed is printed with each violation so a failure replays.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import yaml

from modelfleet.core.catalog import Catalog
from modelfleet.messages.admin import MAX_HISTORY
from modelfleet.up import RunningFleet
from modelfleet.up.children import Child, UpError
from modelfleet.up.fleet import wait_serving

A = {"name": "a", "engine": "sim", "replicas": 2, "args": ["--itl", "0.005"]}
E = {"name": "e", "engine": "sim", "replicas": 1}


@dataclass
class Pending:
    """Something to do later: resume a frozen process, or start a killed one again."""

    at: float
    what: str
    child: Child


@dataclass
class Nemesis:
    """The schedule, what was done, and every write the fleet acknowledged."""

    running: RunningFleet
    seed: int
    step_s: tuple[float, float] = (0.5, 2.0)  # between two actions, drawn
    rng: random.Random = field(init=False)
    done: list[str] = field(default_factory=list)  # what it did, with times, for a replay
    pending: list[Pending] = field(default_factory=list)
    keys_made: dict[str, str] = field(default_factory=dict)  # acknowledged: name -> key
    keys_revoked: set[str] = field(default_factory=set)  # acknowledged
    keys_revoke_asked: set[str] = field(default_factory=set)  # acknowledged or not
    catalogs_acked: list[int] = field(default_factory=list)  # versions answered
    catalog_last: dict[str, Any] | None = None  # the last acknowledged catalog
    catalogs_asked_after: list[dict[str, Any]] = field(default_factory=list)  # since then
    began: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        token = self.running.admin_token
        self.http = httpx.Client(headers={"authorization": f"Bearer {token}"}, timeout=3)
        self.ttl = 3.0

    # -- the schedule ----------------------------------------------------------------------

    def run(self, seconds: float) -> None:
        """Act for `seconds`, then let every fault go."""
        end = time.monotonic() + seconds
        actions: list[tuple[float, Callable[[], None]]] = [
            (3, self.kill_control_plane),
            (3, self.freeze_control_plane),
            (2, self.kill_agent),
            (2, self.freeze_store),
            (1, self.kill_store),
            (4, self.change_catalog),
            (4, self.make_key),
            (3, self.revoke_key),
        ]
        weights = [w for w, _ in actions]
        while time.monotonic() < end:
            self.settle_pending(time.monotonic())
            _, act = self.rng.choices(actions, weights)[0]
            act()
            time.sleep(self.rng.uniform(*self.step_s))
        self.settle_pending(None)

    def note(self, what: str) -> None:
        self.done.append(f"{time.monotonic() - self.began:7.1f}s {what}")

    def later(self, seconds: float, what: str, child: Child) -> None:
        self.pending.append(Pending(time.monotonic() + seconds, what, child))

    def settle_pending(self, now: float | None) -> None:
        """Resume or start again what is due (everything when `now` is None)."""
        due = [p for p in self.pending if now is None or p.at <= now]
        # PostgreSQL first: a control plane started again waits for its store.
        due.sort(key=lambda p: p.child.role != "postgres")
        for p in due:
            store_out = any(q.child.role == "postgres" for q in self.pending if q is not p)
            if (
                now is not None
                and p.what == "start"
                and p.child.role == "control-plane"
                and store_out
            ):
                # It would wait for its store (tested on its own in test_store), and its
                # start would hold the whole schedule up meanwhile: started once it is back.
                p.at = time.monotonic() + 0.5
                continue
            self.pending.remove(p)
            if p.what == "resume":
                os.killpg(p.child.proc.pid, signal.SIGCONT)
                self.note(f"SIGCONT {p.child.label or p.child.role}")
            else:
                self.start_again(p.child)

    def start_again(self, child: Child) -> None:
        name = child.label or child.role
        try:
            self.running.fleet.restart(child, timeout=60)
        except UpError as exc:
            self.note(f"could not start {name} again: {str(exc).splitlines()[0]}")
            self.later(1.0, "start", child)
            return
        self.note(f"started {name} again")

    def busy(self, child: Child) -> bool:
        """Frozen or killed and not back yet: left alone meanwhile."""
        return any(p.child is child for p in self.pending)

    def pick(self, role: str) -> Child | None:
        free = [c for c in self.running.fleet.children if c.role == role and not self.busy(c)]
        return self.rng.choice(free) if free else None

    # -- faults ----------------------------------------------------------------------------

    def kill_control_plane(self) -> None:
        if (child := self.pick("control-plane")) is None:
            return
        os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait()
        self.note(f"kill -9 {child.label}")
        self.later(self.rng.uniform(0, 3), "start", child)

    def freeze_control_plane(self) -> None:
        if (child := self.pick("control-plane")) is None:
            return
        os.killpg(child.proc.pid, signal.SIGSTOP)
        self.note(f"SIGSTOP {child.label}")
        self.later(self.rng.uniform(0.5, 3) * self.ttl, "resume", child)

    def kill_agent(self) -> None:
        if (child := self.pick("agent")) is None:
            return
        # The agent only: its engines run in groups of their own and are adopted again.
        os.kill(child.proc.pid, signal.SIGKILL)
        child.proc.wait()
        self.note(f"kill -9 agent of {child.node}")
        self.later(self.rng.uniform(0, 3), "start", child)

    def freeze_store(self) -> None:
        if (child := self.pick("postgres")) is None:
            return
        os.killpg(child.proc.pid, signal.SIGSTOP)
        self.note("SIGSTOP postgres")
        self.later(self.rng.uniform(1, 10), "resume", child)

    def kill_store(self) -> None:
        if (child := self.pick("postgres")) is None:
            return
        os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait()
        self.note("kill -9 postgres")
        self.later(self.rng.uniform(0, 5), "start", child)

    # -- changes ---------------------------------------------------------------------------

    def _send(self, method: str, path: str, body: bytes | None) -> httpx.Response | None:
        """One change, to the control planes in turn (a follower's 307 followed, as ctl
        does); the first answer that is not a failure to reach one, or None."""
        urls = list(self.running.admin_urls)
        self.rng.shuffle(urls)
        for url in urls:
            try:
                answer = self.http.request(method, url + path, content=body)
                if answer.status_code == 307:
                    answer = self.http.request(method, answer.headers["location"], content=body)
            except httpx.HTTPError:
                continue
            if answer.status_code == 200:
                return answer
        return None

    def change_catalog(self) -> None:
        models = [{**A, "replicas": self.rng.choice([2, 3])}]
        if self.rng.random() < 0.5:
            models.append(E)
        wanted = {"models": models}
        self.catalogs_asked_after.append(wanted)
        answer = self._send("PUT", "/v1/catalog", yaml.safe_dump(wanted).encode())
        shown = ", ".join(f"{m['name']}x{m['replicas']}" for m in models)
        if answer is None:
            self.note(f"catalog {shown}: not acknowledged")
            return
        version = int(answer.json()["version"])
        self.catalogs_acked.append(version)
        self.catalog_last, self.catalogs_asked_after = wanted, []
        self.note(f"catalog {shown}: version {version}")

    def make_key(self) -> None:
        name = f"nemesis-{len(self.done)}-{self.rng.randrange(10**6)}"
        answer = self._send("POST", "/v1/keys", json.dumps({"name": name}).encode())
        if answer is None:
            self.note(f"key {name}: not acknowledged")
            return
        self.keys_made[name] = answer.json()["key"]
        self.note(f"key {name} made")

    def revoke_key(self) -> None:
        live = sorted(set(self.keys_made) - self.keys_revoked)
        if not live:
            return
        name = self.rng.choice(live)
        self.keys_revoke_asked.add(name)  # unanswered, it may still have been revoked
        answer = self._send("DELETE", f"/v1/keys/{name}", None)
        if answer is None:
            self.note(f"key {name} revoke: not acknowledged")
            return
        self.keys_revoked.add(name)
        self.note(f"key {name} revoked")

    # -- the checks ------------------------------------------------------------------------

    def leader_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for url in self.running.admin_urls:
                try:
                    status = self.http.get(url + "/v1/status").json()
                except (httpx.HTTPError, ValueError):
                    continue
                if status.get("leading") and status.get("reconcile_passes", 0) > 0:
                    return url
            time.sleep(0.1)
        raise RuntimeError(f"no control plane led within {timeout:.0f}s after the nemesis")

    def check(self, settle_s: float = 120) -> list[str]:
        """What the fleet broke of its promises; empty when it kept them all."""
        violations: list[str] = []
        leader = self.leader_url(60)
        listed = {k["name"] for k in self.http.get(leader + "/v1/keys").json()["keys"]}
        for name in sorted(set(self.keys_made) - self.keys_revoke_asked - listed):
            violations.append(f"key {name} was made (200) and is not in the store")
        for name in sorted(self.keys_revoked & listed):
            violations.append(f"key {name} was revoked (200) and is still in the store")
        limit = {"limit": MAX_HISTORY}
        history = self.http.get(leader + "/v1/catalog/history", params=limit).json()
        versions = {v["version"] for v in history["versions"]}
        for version in self.catalogs_acked:
            if version not in versions:
                violations.append(f"catalog version {version} was answered and is not kept")
        current = self.http.get(leader + "/v1/catalog").json()
        now = {m["name"]: m["replicas"] for m in current["models"]}
        allowed = [self.catalog_last, *self.catalogs_asked_after]
        shapes = [{m["name"]: m["replicas"] for m in c["models"]} for c in allowed if c]
        if shapes and now not in shapes:
            violations.append(f"the catalog now is {now}; the writes allowed it to be {shapes}")
        violations += self._engines_match(current, settle_s)
        violations += self._epochs_held_once()
        return [f"{v} (seed {self.seed})" for v in violations]

    def _engines_match(self, current: dict[str, Any], settle_s: float) -> list[str]:
        models = [{**(A if m["name"] == "a" else E), **m} for m in _shapes(current)]
        catalog = Catalog.from_yaml(yaml.safe_dump({"models": models}))
        if not wait_serving(self.running.push_url, self.running.admin_token, catalog, settle_s):
            return [f"the router serves not every replica of {_shapes(current)}"]
        shards = sum(m.replicas for m in catalog.models)
        deadline, engines = time.monotonic() + settle_s, -1
        while time.monotonic() < deadline:
            recorded = [p for pids in self.running.fleet.engine_pids().values() for p in pids]
            engines = sum(1 for pid in recorded if alive(pid))
            if engines == shards:
                return []
            time.sleep(0.2)
        return [f"{engines} engines run for the catalog's {shards} shards"]

    def _epochs_held_once(self) -> list[str]:
        led: dict[int, set[str]] = {}
        for child in self.running.fleet.children:
            if child.role != "control-plane":
                continue
            text = child.log.read_text(errors="replace")
            for epoch in re.findall(r"leading under epoch (\d+)", text):
                led.setdefault(int(epoch), set()).add(child.label)
        return [
            f"epoch {epoch} was led by {sorted(planes)}"
            for epoch, planes in sorted(led.items())
            if len(planes) > 1
        ]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _shapes(current: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"name": m["name"], "replicas": m["replicas"]} for m in current["models"]]
