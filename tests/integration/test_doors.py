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
from pathlib import Path
from typing import Any

import pytest
import yaml

from modelfleet.security.pki import client_context
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
