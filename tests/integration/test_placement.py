"""Placement on a running fleet: why a model is not placed, and placing it once the cause is
fixed; a drain moving replicas make-before-break under load. Real processes throughout."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelfleet.http.loadgen import SteadyClient
from modelfleet.up import RunningFleet

from .conftest import Operator, fleet_of, wait_for, wait_requests

RECONCILE_INTERVAL = 0.5
OPTIONS = {"gpus": "2x80GB", "reconcile_interval": RECONCILE_INTERVAL, "stop_grace": 10}
BIG = {"name": "big", "engine": "sim", "gpus_per_shard": 2, "gpu_memory": "60GiB"}


@pytest.fixture
def small_fleet(tmp_path: Path) -> Iterator[RunningFleet]:
    with fleet_of(tmp_path, [], **OPTIONS) as fleet:
        yield fleet


def test_an_unplaceable_model_is_explained_and_placed_once_the_cause_is_fixed(
    small_fleet: RunningFleet, tmp_path: Path
) -> None:
    ops = Operator(small_fleet, tmp_path)
    assert "node-1: cordoned (was none)" in ops.ctl("cordon", "node-1").stdout
    ops.gpu("node-2", 1, healthy=False, reason="XID 79")
    wait_for(
        "node-2's gpu 1 unhealthy",
        lambda: "XID 79" in ops.ctl("nodes").stdout,
    )

    _, applied_run = ops.apply(BIG)
    applied = applied_run.stdout
    assert "pending x1" in applied
    pending = wait_for("big pending", lambda: ops.admin.get("/v1/replicas").json()["pending"])
    assert pending[0]["model"] == "big" and "needs 2 GPU(s)" in pending[0]["reason"]
    assert "pending x1" in ops.ctl("replicas").stdout

    explained = ops.ctl("explain-placement", "big").stdout
    assert "node cordoned" in explained
    assert "gpu 1 unhealthy: XID 79" in explained
    as_json = json.loads(ops.ctl("explain-placement", "big", "-o", "json").stdout)
    reasons = {n["node"]: " ".join(n["reasons"]) for n in as_json["nodes"]}
    assert set(reasons) == {"node-1", "node-2"} and not as_json["placeable"]
    assert "has 1" in reasons["node-2"]

    # The GPU recovers: placed once the agent has reported it.
    fixed = time.monotonic()
    ops.gpu("node-2", 1, healthy=True)
    [placed] = wait_for("big placed", lambda: ops.replicas("big"))
    print(f"placed {time.monotonic() - fixed:.2f}s after the GPU recovered")
    assert placed["shards"][0]["node"] == "node-2"

    # A second replica: node-2 is full, node-1 cordoned. Uncordoning places it.
    ops.apply({**BIG, "replicas": 2})
    wait_for("the second pending", lambda: ops.admin.get("/v1/replicas").json()["pending"])
    explained = ops.ctl("explain-placement", "big").stdout
    assert "node cordoned" in explained and "in use" in explained
    fixed = time.monotonic()
    assert "node-1: none (was cordoned)" in ops.ctl("uncordon", "node-1").stdout
    wait_for("two replicas", lambda: len(ops.replicas("big")) == 2)
    print(f"placed {time.monotonic() - fixed:.2f}s after the uncordon")
    wait_for("both ready", lambda: [r["state"] for r in ops.replicas("big")] == ["ready", "ready"])


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[RunningFleet]:
    model = {"name": "a", "engine": "sim", "replicas": 2, "args": ["--itl", "0.005"]}
    with fleet_of(tmp_path, [model], **OPTIONS) as fleet:
        yield fleet


def test_drain_moves_replicas_make_before_break_under_load(
    fleet: RunningFleet, tmp_path: Path
) -> None:
    ops = Operator(fleet, tmp_path)
    wait_for(
        "a on both nodes",
        lambda: (
            sorted(r["shards"][0]["node"] for r in ops.replicas("a") if r["state"] == "ready")
            == ["node-1", "node-2"]
        ),
    )
    client = SteadyClient(fleet.router_url, fleet.api_key, "a")
    client.start()
    try:
        wait_requests(client, 10, " before the drain")
        out = ops.ctl("drain", "node-1", "--grace", "60").stdout
        assert "node-1: draining (was none)" in out
        assert "start" in out and "node draining" in out  # the plan: a move off node-1

        def moved() -> bool:
            reps = ops.replicas("a")
            nodes = [r["shards"][0]["node"] for r in reps if r["state"] == "ready"]
            return len(reps) == 2 and nodes == ["node-2", "node-2"]

        wait_for("a off node-1", moved)
        shown = wait_for(
            "node-1 drained", lambda: (s := ops.ctl("nodes").stdout).count("(done)") and s
        )
        assert "draining (done)" in shown
        wait_requests(client, 10, " after the drain")
    finally:
        client.stop()
    print(f"model a: {client.ok} requests, {client.rate:.1f}/s, failures: {client.failures}")
    assert client.failures == [] and client.ok > 0
    assert ops.admin.get("/v1/replicas").json()["pending"] == []


def test_a_gpu_that_fails_under_a_replica_gets_it_replaced_make_before_break(
    tmp_path: Path,
) -> None:
    model = {"name": "a", "engine": "sim", "args": ["--itl", "0.005"]}
    with fleet_of(tmp_path, [model], **OPTIONS) as fleet:
        ops = Operator(fleet, tmp_path)
        [first] = wait_for(
            "a ready", lambda: [r for r in ops.replicas("a") if r["state"] == "ready"]
        )
        node, [gpu] = first["shards"][0]["node"], first["shards"][0]["gpus"]
        client = SteadyClient(fleet.router_url, fleet.api_key, "a")
        client.start()
        try:
            wait_requests(client, 10, " before the fault")
            ops.gpu(node, gpu, healthy=False, reason="XID 79")
            [moved] = wait_for(
                "a replaced off the failed GPU",
                lambda: [
                    r for r in ops.replicas("a") if r["state"] == "ready" and r["id"] != first["id"]
                ],
            )
            wait_for("the old replica gone", lambda: len(ops.replicas("a")) == 1)
            wait_requests(client, 10, " after the move")
        finally:
            client.stop()
        print(f"model a: {client.ok} requests, failures: {client.failures}")
        assert client.failures == [] and client.ok > 0
        assert (moved["shards"][0]["node"], moved["shards"][0]["gpus"]) != (node, [gpu])
        gone = ops.admin.get(f"/v1/replicas/{first['id']}")
        assert gone.status_code == 404 and f"gpu {gpu} of {node} unhealthy: XID 79" in gone.text


def test_drain_wait_says_what_is_left_and_why_until_it_is_done(tmp_path: Path) -> None:
    """Two nodes of one GPU, both used: a drain of node-1 cannot place a replacement, so
    `--wait` says why, and the drain finishes when its grace period is over."""
    model = {"name": "a", "engine": "sim", "replicas": 2}
    with fleet_of(tmp_path, [model], **{**OPTIONS, "gpus": "1x80GB"}) as fleet:
        ops = Operator(fleet, tmp_path)
        wait_for("a ready twice", lambda: [r["state"] for r in ops.replicas("a")] == ["ready"] * 2)
        [held] = [r["id"] for r in ops.replicas("a") if r["shards"][0]["node"] == "node-1"]
        done = ops.ctl("drain", "node-1", "--grace", "3", "--wait")
        out = done.stdout
        assert "node-1: draining (was none)" in out
        assert f"{held} (a): its replacement cannot be placed" in out and "in use" in out
        assert out.rstrip().endswith("node node-1 drained: nothing runs there")
