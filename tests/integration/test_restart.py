"""A control plane restarted under load: it starts from the last applied catalog and adopts
the replicas that run instead of placing new ones, and clients notice nothing."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from modelfleet.http.loadgen import SteadyClient
from modelfleet.up import RunningFleet

from .conftest import Operator, fleet_of, wait_for, wait_requests

A = {"name": "a", "engine": "sim", "replicas": 2, "args": ["--ttft", "0.02", "--itl", "0.005"]}
B = {"name": "b", "engine": "sim"}


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[RunningFleet]:
    with fleet_of(tmp_path, [A]) as running:
        yield running


def replicas(admin: httpx.Client) -> dict[str, tuple[str, tuple[int | None, ...]]]:
    """replica id -> (state, engine pids)."""
    data = admin.get("/v1/replicas").json()["replicas"]
    return {r["id"]: (r["state"], tuple(s["pid"] for s in r["shards"])) for r in data}


def test_a_restarted_control_plane_keeps_its_catalog_and_adopts_what_runs(
    fleet: RunningFleet,
) -> None:
    admin = httpx.Client(
        base_url=fleet.admin_url,
        headers={"authorization": f"Bearer {fleet.admin_token}"},
        timeout=5,
    )
    applied = admin.put("/v1/catalog", content=yaml.safe_dump({"models": [A, B]})).json()
    assert applied["version"] == 2
    wait_for(
        "three ready replicas",
        lambda: [s for s, _ in replicas(admin).values()].count("ready") == 3,
    )
    before = replicas(admin)
    catalog_before = admin.get("/v1/catalog").json()

    client = SteadyClient(fleet.router_url, fleet.api_key, "a")
    client.start()
    try:
        wait_requests(client, 10, " before the restart")
        [cp] = [c for c in fleet.fleet.children if c.role == "control-plane"]
        old_pid = cp.proc.pid
        urls = fleet.fleet.restart(cp)["urls"]
        assert cp.proc.pid != old_pid
        admin = httpx.Client(
            base_url=urls["admin"],
            headers={"authorization": f"Bearer {fleet.admin_token}"},
            timeout=5,
        )
        wait_for("the replicas adopted", lambda: replicas(admin) == before)
        passes = admin.get("/v1/status").json()["reconcile_passes"]
        wait_for(
            "three reconcile passes after the adoption",
            lambda: admin.get("/v1/status").json()["reconcile_passes"] >= passes + 3,
        )
        assert replicas(admin) == before  # nothing was placed anew or stopped in those passes
        # A new epoch: its versions count from 1 again, and the router takes them over the
        # higher versions of the epoch before.
        status = admin.get("/v1/status").json()
        assert status["routing_epoch"] == 2
        push = {"authorization": f"Bearer {fleet.admin_token}"}
        wait_for(
            "the router to hold the new epoch's table",
            lambda: (
                httpx.get(f"{fleet.push_url}/v1/routing/held", headers=push).json()["epoch"] == 2
            ),
        )
        catalog_after = admin.get("/v1/catalog").json()
        assert (catalog_after["version"], catalog_after["digest"]) == (
            catalog_before["version"],
            catalog_before["digest"],
        )
        assert catalog_after["source"] == "api"
    finally:
        client.stop()
    print(f"model a: {client.ok} requests, {client.rate:.1f}/s, failures: {client.failures}")
    assert client.failures == [] and client.ok > 0


def test_a_router_killed_under_load_serves_at_once_when_back(fleet: RunningFleet) -> None:
    """kill -9 of the router: while it is down clients cannot connect, and once it is back it
    serves every model at once (from the table it kept) and takes the control plane's current
    one: no request gets a 404 or a 503."""
    op_headers = {"authorization": f"Bearer {fleet.admin_token}"}
    wait_for(
        "both replicas of a routed",
        lambda: (
            [
                len(m["endpoints"])
                for m in httpx.get(f"{fleet.admin_url}/v1/routing", headers=op_headers).json()[
                    "models"
                ]
            ]
            == [2]
        ),
    )
    client = SteadyClient(fleet.router_url, fleet.api_key, "a")
    client.start()
    try:
        wait_requests(client, 10, " before the kill")
        [router] = [c for c in fleet.fleet.children if c.role == "router"]
        os.kill(router.proc.pid, signal.SIGKILL)
        router.proc.wait()
        fleet.fleet.restart(router)
        wait_requests(client, 40, " by the restarted router")
        held = httpx.get(f"{fleet.push_url}/v1/routing/held", headers=op_headers, timeout=5)
        status = httpx.get(f"{fleet.admin_url}/v1/status", headers=op_headers).json()
        wait_for(
            "the restarted router to hold the control plane's current table",
            lambda: (
                httpx.get(f"{fleet.push_url}/v1/routing/held", headers=op_headers).json()
                == {
                    "applied": True,
                    "epoch": status["routing_epoch"],
                    "version": status["routing_version"],
                }
            ),
        )
        assert held.status_code == 200
    finally:
        client.stop()
    http_errors = [f for f in client.failures if "HTTP " in f]
    print(f"model a: {client.ok} requests, {len(client.failures)} failed to connect or cut")
    assert http_errors == [] and client.ok > 0


def test_a_router_that_never_answers_holds_up_no_pass(tmp_path: Path) -> None:
    """A second router accepts the control plane's connections and never answers (its push
    times out after 5 s): reconcile passes go on meanwhile, and the working router gets each
    change at once. When the control plane awaited its pushes, every pass waited 5 s."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)  # the kernel accepts connections; nobody ever reads or answers them
    try:
        url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        options = {"reconcile_interval": 0.2, "extra_routers": (url,)}
        with fleet_of(tmp_path, [A], **options) as running:
            op = Operator(running, tmp_path)
            wait_for("a to serve", lambda: op.serves("a"))
            passes = op.passes()
            wait_for("six more reconcile passes", lambda: op.passes() >= passes + 6, timeout=4)
            op.apply(A, B)
            wait_for("b to serve through the working router", lambda: op.serves("b"), timeout=4)
    finally:
        hung.close()


def test_a_router_holding_a_table_stamped_ahead_takes_the_current_one(
    fleet: RunningFleet, tmp_path: Path
) -> None:
    """The router holds a table whose version came from a clock far ahead (then stepped back),
    and the control plane restarts. Versions are (epoch, counter), so the restarted one's
    tables, of a newer epoch, replace it, and a change reaches the router. With versions from
    the wall clock, the router refused every push from then on, and the control plane counted
    each refusal as a confirmation."""
    op = Operator(fleet, tmp_path)
    wait_for("a to serve", lambda: op.serves("a"))
    push = {"authorization": f"Bearer {fleet.admin_token}"}
    routed = httpx.get(f"{fleet.push_url}/v1/routing", headers=push).json()
    epoch = op.get("/v1/status")["routing_epoch"]
    ahead = {**routed, "epoch": epoch, "version": 10**15}  # a clock years ahead, in ms
    assert httpx.put(f"{fleet.push_url}/v1/routing", json=ahead, headers=push).status_code == 200

    [cp] = [c for c in fleet.fleet.children if c.role == "control-plane"]
    urls = fleet.fleet.restart(cp)["urls"]
    op.admin = httpx.Client(base_url=urls["admin"], headers=push, timeout=10)
    op.apply(A, B)
    wait_for("b to serve through the router", lambda: op.serves("b"))
    held = httpx.get(f"{fleet.push_url}/v1/routing/held", headers=push).json()
    assert held["epoch"] == epoch + 1 == op.get("/v1/status")["routing_epoch"]
