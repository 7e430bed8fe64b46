"""Catalog changes on a running fleet: eight in a row while a client keeps using model A.

Real processes: router, control plane and two agents started the way `modelfleet up` starts
them, simulated engines started by the agents. Changes go in by the watched file and by
`modelfleet ctl catalog apply`; nothing is restarted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelfleet.http.loadgen import SteadyClient
from modelfleet.up import RunningFleet

from .conftest import Operator, fleet_of, wait_for, wait_requests

A = {"name": "a", "engine": "sim", "args": ["--ttft", "0.02", "--itl", "0.005"]}
B = {"name": "b", "engine": "sim"}
C = {"name": "c", "engine": "sim", "args": ["--ttft", "0.02"]}


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[RunningFleet]:
    with fleet_of(tmp_path, [A], stop_grace=10) as running:
        yield running


def wait_served(op: Operator, model: str, began: float) -> None:
    """Wait until `model` serves through the router; print how long that took after the change
    (bench/catalog_swap.py measures it; a test asserts no timing)."""
    wait_for(f"{model} to serve", lambda: op.serves(model))
    took = time.monotonic() - began
    ready = wait_for(
        f"a ready replica of {model}",
        lambda: [r for r in op.replicas(model) if r["state"] == "ready"],
    )
    startup = max(s["startup_s"] for r in ready for s in r["shards"])
    print(f"{model}: served {took:.2f}s after the change; its engine took {startup:.2f}s to start")


def gpus_of(replicas: list[dict[str, Any]]) -> set[tuple[str, int]]:
    return {(s["node"], g) for r in replicas for s in r["shards"] for g in s["gpus"]}


def test_eight_catalog_changes_while_a_client_uses_model_a(
    fleet: RunningFleet, tmp_path: Path
) -> None:
    op = Operator(fleet, tmp_path)
    wait_for("a to serve", lambda: op.serves("a"))
    client = SteadyClient(fleet.router_url, fleet.api_key, "a")
    client.start()
    try:
        wait_requests(client, 10, " before the first change")

        # 1. add B (file)
        began = op.write_file(A, B)
        wait_served(op, "b", began)

        # 2. scale B to 2 (ctl)
        _, done = op.apply(A, {**B, "replicas": 2})
        assert done.returncode == 0, done.stderr
        assert "applied: catalog version" in done.stdout and "start" in done.stdout
        wait_for("two endpoints of b", lambda: len(op.routed("b") or []) == 2)

        # 3. add C (file)
        began = op.write_file(A, {**B, "replicas": 2}, C)
        wait_served(op, "c", began)
        [old_c] = op.replicas("c")

        # 4. change C's engine arguments (ctl): replaced make-before-break, so a client of C
        # sees no failure either
        client_c = SteadyClient(fleet.router_url, fleet.api_key, "c", workers=2)
        client_c.start()
        c2 = {**C, "args": ["--ttft", "0.03"]}
        _, done = op.apply(A, {**B, "replicas": 2}, c2)
        assert done.returncode == 0, done.stderr

        def replaced() -> bool:
            reps = op.replicas("c")
            return [r["id"] for r in reps] != [old_c["id"]] and len(reps) == 1

        wait_for("c replaced", replaced)
        wait_requests(client_c, 10, " by the new replica of c")
        client_c.stop()
        print(f"model c during its replacement: {client_c.ok} requests, {client_c.failures}")
        assert client_c.failures == [] and client_c.ok > 0

        # 5. remove B (file): out of the router, then stopped, its GPUs free
        b_gpus = gpus_of(op.replicas("b"))
        assert len(b_gpus) == 2
        op.write_file(A, c2)
        wait_for("b out of the routing table", lambda: op.routed("b") is None)
        wait_for("b's GPUs free", lambda: not (op.used_gpus() & b_gpus))
        shown = json.loads(op.ctl("nodes", "-o", "json").stdout)["nodes"]
        in_use = {(n["name"], g["index"]) for n in shown for g in n["gpus"] if g["in_use"]}
        assert not (in_use & b_gpus)
        assert "b" not in op.ctl("replicas").stdout.split()

        # 6. an invalid catalog, by ctl and by the file: nothing changes
        before = op.get("/v1/catalog")
        replicas_before = sorted(r["id"] for r in op.get("/v1/replicas")["replicas"])
        _, done = op.apply(A, {"name": "d", "engine": "vlm", "replica": 2}, check=False)
        assert done.returncode == 1
        assert "unknown engine 'vlm'" in done.stderr and "did you mean 'replicas'" in done.stderr
        bad = fleet.catalog_file.read_text().replace("engine: sim", "engine: simm", 1)
        fleet.catalog_file.write_text(bad)
        show = wait_for(
            "the file's rejection",
            lambda: (s := op.ctl("catalog", "show")).stdout.count("simm") and s,
        )
        assert "last rejected attempt" in show.stdout and str(fleet.catalog_file) in show.stdout
        after = op.get("/v1/catalog")
        assert (after["version"], after["digest"]) == (before["version"], before["digest"])
        assert sorted(r["id"] for r in op.get("/v1/replicas")["replicas"]) == replicas_before

        # 7. remove C (ctl)
        c_gpus = gpus_of(op.replicas("c"))
        _, done = op.apply(A)
        assert done.returncode == 0, done.stderr
        wait_for("c's GPUs free", lambda: not (op.used_gpus() & c_gpus))
        assert op.routed("c") is None

        # 8. add B again (file)
        began = op.write_file(A, B)
        wait_served(op, "b", began)
        wait_requests(client, 10, " after the last change")
    finally:
        client.stop()

    print(f"model a: {client.ok} requests, {client.rate:.1f}/s, failures: {client.failures}")
    assert client.failures == [] and client.ok > 0
    history = json.loads(op.ctl("catalog", "history", "-o", "json").stdout)["versions"]
    assert [v["version"] for v in history][:1] == [8]  # 1 + seven valid changes
    assert [m for m in history[0]["models"]] == ["a", "b"]


def test_a_comment_in_the_file_after_an_apply_changes_nothing(
    fleet: RunningFleet, tmp_path: Path
) -> None:
    """`ctl catalog apply` writes the catalog file too: an operator who then edits the file
    (here: adds a comment) starts from what is current instead of reverting it."""
    op = Operator(fleet, tmp_path)
    _, done = op.apply(A, B)
    assert done.returncode == 0, done.stderr
    version = op.get("/v1/catalog")["version"]
    with fleet.catalog_file.open("a") as f:
        f.write("# checked by the operator\n")
    op.wait_passes(3)  # the file is read every 0.25 s, a pass runs every 0.5 s
    after = op.get("/v1/catalog")
    assert after["version"] == version and [m["name"] for m in after["models"]] == ["a", "b"]
    assert "ctl catalog apply" in fleet.catalog_file.read_text()
    wait_for("b to serve", lambda: op.serves("b"))
