"""Issue 57, "nothing was changed, and it was": a change whose store call timed out during a
PostgreSQL stall of 2 s was answered 503 "nothing was changed", and landed: a key stored but
never given to the routers, a catalog current with no CatalogApplied event. Now it is
answered "may have been made" with its request id; it lands once whatever is sent again with
that id (the answer says the earlier attempt made it); and the leader takes what landed into
memory, with its event. PostgreSQL is frozen as a hung host is: SIGSTOP of the server and
its sessions."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from modelfleet.host.pgserver import PgServer

from .conftest import Procs, wait_for, wait_json

TOKEN = "admin-token-of-the-test"
IDEMPOTENCY_KEY, REPLAYED = "Idempotency-Key", "Idempotent-Replayed"
STALL_S = 2.0


@pytest.fixture
def pg() -> Iterator[PgServer]:
    folder = Path(tempfile.mkdtemp(prefix="modelfleet-pg-stall-"))
    server = PgServer(folder)
    server.start()
    try:
        yield server
    finally:
        server.stop("immediate")
        shutil.rmtree(folder, ignore_errors=True)


class Fleet:
    """One control plane on `pg`, and what a test does to both."""

    def __init__(self, pg: PgServer, procs: Procs, tmp_path: Path) -> None:
        self.pg = pg
        self.procs = procs
        catalog = tmp_path / "catalog.yaml"
        catalog.write_text(yaml.safe_dump({"models": [{"name": "m", "engine": "sim"}]}))
        config = {"state_dir": str(tmp_path / "state"), "catalog": str(catalog),
                  "agent_port": 0, "admin_port": 0, "admin_token": TOKEN,
                  "store": pg.conninfo(), "lease_ttl": 3.0}  # fmt: skip
        (tmp_path / "cp.yaml").write_text(yaml.safe_dump(config))
        self.proc = procs.start("control-plane", "--config", str(tmp_path / "cp.yaml"),
                                "--ready-file", str(tmp_path / "cp.json"), log="cp")  # fmt: skip
        self.url = wait_json(tmp_path / "cp.json", self.proc)["urls"]["admin"]
        self.admin = httpx.Client(
            base_url=self.url, headers={"authorization": f"Bearer {TOKEN}"}, timeout=10
        )
        self.refused: list[str] = []  # what was answered "nothing was changed" meanwhile

    def ready(self) -> bool:
        status = self.admin.get("/v1/status").json()
        return bool(status["leading"]) and not status.get("store_problem")

    def stalled(
        self, send: Callable[[], httpx.Response], what: str, stall_s: float = STALL_S
    ) -> httpx.Response:
        """`send()` while PostgreSQL is frozen for `stall_s`: its answer when the change was
        sent to the store (tried again when the control plane refused it at once, its store
        already unreachable: a lease renewal timed out first)."""
        for _ in range(5):
            wait_for("the control plane leading, its store answering", self.ready, 30)
            pids = self.pg.pids()

            def thaw(pids: list[int] = pids) -> None:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)

            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            thawing = threading.Timer(stall_s, thaw)  # the stall lasts what it lasts
            thawing.start()
            try:
                answer = send()
            finally:
                thawing.join()
            if answer.json().get("may_have_been_made"):
                return answer
            said = answer.json()["error"]
            assert answer.status_code == 503, answer.text
            # Refused at once, never sent: its store unreachable already (a lease renewal
            # timed out first). Not a call sent to the store that did not answer in time.
            assert "is unreachable since" in said and "nothing was changed" in said, said
            self.refused.append(what)
        raise AssertionError(f"{what}: never sent to the store during a stall")

    def events(self, reason: str) -> list[dict[str, Any]]:
        answer = self.admin.get("/v1/events")
        if answer.status_code != 200:  # the store not answering yet: not yet
            return []
        return [e for e in answer.json()["events"] if e["reason"] == reason]


def test_a_change_timed_out_in_a_store_stall_may_have_been_made_and_is_made_once(
    pg: PgServer, procs: Procs, tmp_path: Path
) -> None:
    fleet = Fleet(pg, procs, tmp_path)
    admin_api = fleet.admin

    # A key made while PostgreSQL stalls.
    rid = uuid.uuid4().hex
    made = fleet.stalled(
        lambda: admin_api.post(
            "/v1/keys", json={"name": "stalled"}, headers={IDEMPOTENCY_KEY: rid}
        ),
        "key",
    )
    said = made.json()
    assert made.status_code == 503 and said["request_id"] == rid, made.text
    assert "may have been made" in said["error"] and "nothing was changed" not in said["error"]
    assert made.headers[IDEMPOTENCY_KEY] == rid
    # It landed once the store woke: the leader holds it (and so gives it to routers), told.
    wait_for(
        "the key that landed late held by the leader",
        lambda: "stalled" in [k["name"] for k in admin_api.get("/v1/keys").json()["keys"]],
        15,
    )
    wait_for("its KeyCreated event", lambda: fleet.events("KeyCreated"), 15)
    prefix = admin_api.get("/v1/keys").json()["keys"][0]["prefix"]
    # Sent again with its request id: not made twice; the answer says the first made it.
    again = admin_api.post("/v1/keys", json={"name": "stalled"}, headers={IDEMPOTENCY_KEY: rid})
    assert again.status_code == 409 and again.headers[REPLAYED] == "true", again.text
    assert "made by an earlier attempt" in again.json()["error"]
    [kept] = admin_api.get("/v1/keys").json()["keys"]
    assert kept["prefix"] == prefix  # the same key: not made again

    # A catalog applied while PostgreSQL stalls.
    before = admin_api.get("/v1/catalog").json()["version"]
    rid = uuid.uuid4().hex
    catalog = yaml.safe_dump({"models": [{"name": "m", "engine": "sim", "replicas": 2}]})
    applied = fleet.stalled(
        lambda: admin_api.put("/v1/catalog", content=catalog, headers={IDEMPOTENCY_KEY: rid}),
        "catalog",
    )
    assert applied.status_code == 503 and applied.json()["request_id"] == rid, applied.text
    wait_for(
        "the catalog that landed late current on the leader",
        lambda: admin_api.get("/v1/catalog").json()["version"] == before + 1,
        15,
    )
    wait_for(
        "its CatalogApplied event",
        lambda: any(
            e["regarding"] == f"catalog/{before + 1}" for e in fleet.events("CatalogApplied")
        ),
        15,
    )
    again = admin_api.put("/v1/catalog", content=catalog, headers={IDEMPOTENCY_KEY: rid})
    assert again.status_code == 200 and again.headers[REPLAYED] == "true", again.text
    assert again.json()["version"] == before + 1
    history = admin_api.get("/v1/catalog/history").json()["versions"]
    assert history[0]["version"] == before + 1

    # `ctl`, during a stall long enough for it to start in: it sends the change again with
    # its request id and says which attempt made it.
    ran: list[tuple[int, subprocess.CompletedProcess[str]]] = []

    def run_ctl() -> httpx.Response:
        replicas = 3 + len(ran)  # another catalog each time
        catalog_file = tmp_path / f"catalog-{replicas}.yaml"
        catalog_file.write_text(yaml.safe_dump({"models": [{"name": "m", "engine": "sim",
                                                              "replicas": replicas}]}))  # fmt: skip
        argv = [sys.executable, "-m", "modelfleet", "ctl", "--admin", fleet.url,
                "--token", TOKEN, "catalog", "apply", str(catalog_file)]  # fmt: skip
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        ran.append((replicas, out))
        if "made by" in out.stderr:  # sent again: the first answer said it may have been made
            return httpx.Response(503, json={"may_have_been_made": True})
        # refused at once (its store unreachable already), or sent once the store woke
        return httpx.Response(503, json={"error": f"nothing was changed: {out.stderr}"})

    fleet.stalled(run_ctl, "ctl", stall_s=4.0)
    replicas, done = ran[-1]
    assert done.returncode == 0, done.stdout + done.stderr
    said = done.stderr
    assert "made by the earlier attempt" in said or "made by this attempt" in said, said
    current = admin_api.get("/v1/catalog").json()
    assert current["models"][0]["replicas"] == replicas, (current, said)

    # What was answered "nothing was changed" never landed.
    names = [k["name"] for k in admin_api.get("/v1/keys").json()["keys"]]
    assert names == ["stalled"], (names, fleet.refused)
    assert fleet.proc.poll() is None
