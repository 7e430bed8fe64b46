"""The hostile-client kit (`hostile.py`) against every listener of a running fleet.

The listeners are not named here: they are read from the fleet's ready files (each service
writes the URL, bounds and pid of every listener it opens, `http/serving.py`) and from the
replicas' endpoints (the engines), so a listener added to any service is attacked by these
tests without a test written for it. The fleet runs with `MODELFLEET_MAX_OPEN_FILES` low, so
that every cap is small enough to flood from one test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from modelfleet.agent.gate import GateSettings
from modelfleet.agent.records import recorded_engine_pids
from modelfleet.host.network import address_beyond_loopback
from modelfleet.host.processes import stop_groups
from modelfleet.http.door import DoorBounds
from modelfleet.security.pki import (
    CertificateAuthority,
    client_context,
    client_context_with,
    node_host,
)
from modelfleet.up import RunningFleet

from . import hostile
from .conftest import Operator, Procs, fleet_of, wait_for, wait_json

OPEN_FILES = 900  # each service's caps are fitted to this (http/serving.fit_to_open_files)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningFleet]:
    tmp = tmp_path_factory.mktemp("doors")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MODELFLEET_MAX_OPEN_FILES", str(OPEN_FILES))
        with fleet_of(tmp, [{"name": "m", "engine": "sim", "replicas": 2}]) as running:
            operator = Operator(running, tmp)
            wait_for(
                "two replicas of m ready",
                lambda: sum(r["state"] == "ready" for r in operator.replicas("m")) == 2,
                60,
            )
            yield running


def doors(fleet: RunningFleet) -> list[hostile.Door]:
    """Every listener the fleet registered: each service's ready file, and each engine."""
    engines = [r["endpoint"] for r in Operator(fleet, Path()).replicas() if r.get("endpoint")]
    found = hostile.registered(fleet.catalog_file.parent / "run", engines)
    assert len(found) >= 8, [d.name for d in found]  # router x2, control plane x2, agents, engines
    return found


def served_after(attack: Callable[[hostile.Door], Any]) -> Callable[[hostile.Door], Any]:
    def both(door: hostile.Door) -> Any:
        return attack(door), bool(door.served())

    return both


def test_every_door_closes_slow_heads_and_refuses_huge_ones_deep_bodies_and_bad_utf8(
    fleet: RunningFleet,
) -> None:
    targets = doors(fleet)
    assert hostile.at_once(targets, served_after(hostile.slow_head)) == {
        d.name: ("HTTP/1.1 408 Request Timeout", True) for d in targets
    }
    assert hostile.at_once(targets, served_after(hostile.huge_head)) == {
        d.name: ("HTTP/1.1 431 Request Header Fields Too Large", True) for d in targets
    }
    for attack in (hostile.deep_body, hostile.bad_utf8):
        found = hostile.at_once(targets, served_after(attack))
        for name, (answer, served) in found.items():
            assert served and answer.startswith("HTTP/1.1 4"), (attack.__name__, name, answer)


def test_every_door_shares_its_cap_between_sources(fleet: RunningFleet) -> None:
    """Issue 56: about 400 slow heads locked operators out of the admin API, about 9,850 every
    tenant out of the router. A stranger floods each listener past its cap (idle
    connections and heads that never end) and an honest client from another address is
    served five times over while the flood is open."""
    targets = [d for d in doors(fleet) if d.bounds.get("max_connections", 10**9) <= 1000]
    assert {d.name.split()[0] for d in targets} >= {"router", "control-plane"}, targets

    def attack(door: hostile.Door) -> Any:
        with hostile.flood(door, door.bounds["max_connections"] + 20) as held:
            return len(held) > 0, [bool(door.served()) for _ in range(5)]

    assert hostile.at_once(targets, attack) == {d.name: (True, [True] * 5) for d in targets}


def test_every_door_outlives_churn_and_unread_pipelines(fleet: RunningFleet) -> None:
    """Issue 56: thousands of connections opened and closed (the engine gate's lock-out), and
    pipelined requests never read (a router grew by 88 MiB): each listener is served after
    both, and no process serving one grew by more than 20 MB while its answers went unread."""
    targets = doors(fleet)
    assert hostile.at_once(targets, served_after(lambda door: hostile.churn(door, 300))) == {
        d.name: (None, True) for d in targets
    }
    grown = hostile.at_once([d for d in targets if d.pid], served_after(hostile.pipeline_unread))
    for name, (mb, served) in grown.items():
        assert served and mb <= 20, (name, mb)


def test_the_fleet_wrote_each_listeners_bounds(fleet: RunningFleet) -> None:
    ready = json.loads((fleet.catalog_file.parent / "run" / "router.json").read_text())
    assert set(ready["bounds"]) == set(ready["urls"])
    assert all(b["max_connections"] < OPEN_FILES for b in ready["bounds"].values())
    assert Path(fleet.catalog_file.parent).is_dir()


@pytest.fixture(scope="module")
def tls_doors(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[hostile.Door]]:
    """A control plane and a router on TLS (on loopback, asked for), each process's caps
    fitted to `OPEN_FILES`: their four listeners, reached by honest clients that trust the
    fleet's CA."""
    tmp = tmp_path_factory.mktemp("tls-doors")
    procs = Procs(tmp)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MODELFLEET_MAX_OPEN_FILES", str(OPEN_FILES))
        try:
            config = {"state_dir": "state", "admin_token": "admin-token-of-the-test",
                      "agent_token": "agent-token-of-the-test", "tls": "on", "agent_port": 0,
                      "admin_port": 0}  # fmt: skip
            (tmp / "cp.yaml").write_text(yaml.safe_dump(config))
            cp = procs.start("control-plane", "--config", str(tmp / "cp.yaml"), "--ready-file",
                             str(tmp / "cp.json"), log="cp")  # fmt: skip
            found = wait_json(tmp / "cp.json", cp)
            issued = subprocess.run(
                [sys.executable, "-m", "modelfleet", "certificate", "--state-dir",
                 str(tmp / "state"), "--name", "127.0.0.1", "--out", str(tmp / "tls"), "--stem",
                 "router"], capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            assert issued.returncode == 0, issued.stderr
            router_config = {"port": 0, "push_port": 0, "push_token": "push-token-of-the-test",
                             "tls_cert": str(tmp / "tls" / "router.crt"),
                             "tls_key": str(tmp / "tls" / "router.key")}  # fmt: skip
            (tmp / "router.yaml").write_text(yaml.safe_dump(router_config))
            router = procs.start("router", "--config", str(tmp / "router.yaml"), "--ready-file",
                                 str(tmp / "router.json"), log="router")  # fmt: skip
            routed = wait_json(tmp / "router.json", router)
            trust = client_context(Path(found["ca_file"]).read_bytes())
            made = []
            for described, pid in ((found, cp.pid), (routed, router.pid)):
                for name, url in described["urls"].items():
                    bounds = described["bounds"][name]
                    made.append(hostile.Door(name, url, pid, bounds, tls=trust))
            assert all(d.https for d in made) and len(made) == 4, made
            yield made
        finally:
            procs.stop_all()


def test_every_tls_door_outlives_handshakes_never_begun_or_cut(
    tls_doors: list[hostile.Door],
) -> None:
    """Issue 56: 5,000 connections that never began a TLS handshake held 5,021 file
    descriptors of a control plane for about 60 s against an admin cap of 382. Now each TLS
    listener counts them from accept: past its cap and its handshake cap (from the stranger),
    an honest client that trusts the fleet's CA is served five times over, and the server
    itself closes every connection that never began its handshake within its handshake
    deadline (waited for with a deadline of its own)."""

    def attack(door: hostile.Door) -> Any:
        count = door.bounds["max_connections"] + door.bounds["max_handshakes"] + 20
        with hostile.absent_handshakes(door, count) as held:
            served = [door.served() for _ in range(5)]
            deadline = door.bounds["handshake_timeout"] + 20
            closed = sum(hostile.closed_by_server(sock, deadline) for sock in held)
            return served, closed == len(held) and len(held) > 0

    found = hostile.at_once(tls_doors, attack)
    assert set(found) == {d.name for d in tls_doors}, found
    for name, result in found.items():
        served, closed = result
        assert closed and all(line.startswith("HTTP/1.1 ") for line in served), (name, result)
    assert hostile.at_once(tls_doors, served_after(lambda door: hostile.churn(door, 300))) == {
        d.name: (None, True) for d in tls_doors
    }
    assert hostile.at_once(tls_doors, served_after(hostile.slow_head)) == {
        d.name: ("HTTP/1.1 408 Request Timeout", True) for d in tls_doors
    }


@pytest.fixture(scope="module")
def gated_doors(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[hostile.Door]]:
    """A fleet beyond loopback, as across machines: a control plane on TLS at this machine's
    address beyond loopback, and an agent that joined it from there, whose engine is reached
    through its gate. Its doors as the kit finds them, every ready file and every replica's
    endpoint (the gate, reached with a router's certificate under its node's name)."""
    here = address_beyond_loopback()
    if here is None:
        pytest.skip("this machine has no address beyond loopback for a node to join from")
    tmp = tmp_path_factory.mktemp("gated-doors")
    run = tmp / "run"
    run.mkdir()
    procs = Procs(tmp)
    token = "admin-token-of-the-test"
    (tmp / "catalog.yaml").write_text(
        yaml.safe_dump({"models": [{"name": "m", "engine": "sim", "replicas": 1}]})
    )
    config = {"catalog": str(tmp / "catalog.yaml"), "state_dir": str(tmp / "state"),
              "admin_token": token, "tls": "on", "host": here, "agent_port": 0,
              "admin_port": 0, "heartbeat_interval": 0.5}  # fmt: skip
    (tmp / "cp.yaml").write_text(yaml.safe_dump(config))
    (tmp / "cp.yaml").chmod(0o600)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MODELFLEET_MAX_OPEN_FILES", str(OPEN_FILES))
        try:
            cp = procs.start("control-plane", "--config", str(tmp / "cp.yaml"), "--ready-file",
                             str(run / "control-plane.json"), log="cp")  # fmt: skip
            found = wait_json(run / "control-plane.json", cp)
            ca_pem = Path(found["ca_file"]).read_bytes()
            admin = httpx.Client(base_url=found["urls"]["admin"], timeout=10,
                                 verify=client_context(ca_pem),
                                 headers={"authorization": f"Bearer {token}"})  # fmt: skip
            made = admin.post("/v1/join-tokens", json={"uses": 1, "ttl": "10m"})
            assert made.status_code == 200, made.text
            (tmp / "join-token").write_text(made.json()["token"])
            (tmp / "join-token").chmod(0o600)
            agent = procs.start(
                "agent", "--join", found["urls"]["agent"], "--node", "g", "--simulate-gpus",
                "1x80GB", "--address", here, "--token-file", str(tmp / "join-token"),
                "--state-dir", str(tmp / "g"), "--ready-file", str(run / "agent-g.json"),
                log="agent",
            )  # fmt: skip
            wait_json(run / "agent-g.json", agent, timeout=60)

            def endpoints() -> list[str]:
                replicas = admin.get("/v1/replicas").json()["replicas"]
                return [r["endpoint"] for r in replicas if r["state"] == "ready"]

            wait_for("m ready behind its gate", lambda: len(endpoints()) == 1, 90)
            [gate] = endpoints()
            assert gate.startswith(f"https://{here}:"), gate
            ca = CertificateAuthority.load(tmp / "state" / "pki" / "ca.crt",
                                           tmp / "state" / "pki" / "ca.key")  # fmt: skip
            router = client_context_with(ca_pem, ca.issue_router_client(datetime.now(UTC)))
            defaults = DoorBounds(max_connections=GateSettings.max_connections)
            bounds = {"max_connections": defaults.max_connections, "max_handshakes":
                      defaults.max_handshakes, "handshake_timeout": defaults.handshake_timeout,
                      "head_timeout": 10.0}  # fmt: skip
            found_doors = hostile.registered(run, [])
            for door in found_doors:
                door.tls = client_context(ca_pem) if door.https else None
            made_doors = [*found_doors, hostile.Door(f"engine {gate}", gate, 0, bounds,
                                                     tls=router, sni=node_host("g"))]  # fmt: skip
            assert len(made_doors) >= 3, made_doors  # the control plane's two, the gate
            yield made_doors
        finally:
            procs.stop_all()
            stop_groups(recorded_engine_pids(tmp / "g"), grace=10)


def test_every_door_across_machines_outlives_the_kit_gates_included(
    gated_doors: list[hostile.Door],
) -> None:
    """Issue 56: an engine's gate, the listener other machines reach it at, was attacked by
    tests of its own and not found by the kit. A fleet across machines registers it as its
    replica's endpoint; with the control plane's and the agent's listeners there, each is
    attacked as every listener is, and an honest client (a router, at the gate) is served
    after each attack: heads slow and huge, a flood past the cap from another address, churn,
    and TLS handshakes never begun."""
    names = [d.name for d in gated_doors]
    assert any(n.startswith("engine https://") for n in names), names
    slow = hostile.at_once(gated_doors, served_after(hostile.slow_head))
    assert slow == {d.name: ("HTTP/1.1 408 Request Timeout", True) for d in gated_doors}
    huge = hostile.at_once(gated_doors, served_after(hostile.huge_head))
    assert huge == {
        d.name: ("HTTP/1.1 431 Request Header Fields Too Large", True) for d in gated_doors
    }

    def attack(door: hostile.Door) -> Any:
        count = door.bounds["max_connections"] + door.bounds["max_handshakes"] + 20
        with hostile.absent_handshakes(door, count) as held:
            served = [door.served() for _ in range(5)]
            closed = sum(
                hostile.closed_by_server(sock, door.bounds["handshake_timeout"] + 20)
                for sock in held
            )
            return served, closed == len(held) and len(held) > 0

    tls = [d for d in gated_doors if d.https]
    for name, (served, closed) in hostile.at_once(tls, attack).items():
        assert closed and all(line.startswith("HTTP/1.1 ") for line in served), (name, served)
    assert hostile.at_once(gated_doors, served_after(lambda door: hostile.churn(door, 300))) == {
        d.name: (None, True) for d in gated_doors
    }
