"""The agent with real processes: engines that outlive it, engines that fail, engines that
never become ready."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from modelfleet.host.processes import running as alive
from modelfleet.http.loadgen import SteadyClient
from modelfleet.messages.wire import ShardState
from modelfleet.up import RunningFleet

from .conftest import Operator, fleet_of, wait_for, wait_requests


@pytest.fixture
def steady(tmp_path: Path) -> Iterator[RunningFleet]:
    model = {"name": "a", "engine": "sim", "replicas": 2, "args": ["--itl", "0.02"]}
    with fleet_of(tmp_path, [model]) as fleet:
        yield fleet


def test_engines_outlive_an_agent_killed_with_sigkill_and_are_adopted(
    steady: RunningFleet, tmp_path: Path
) -> None:
    api = Operator(steady, tmp_path).admin

    def ready() -> dict[str, tuple[str, int]]:
        reps = api.get("/v1/replicas").json()["replicas"]
        return {
            r["id"]: (r["shards"][0]["node"], r["shards"][0]["pid"])
            for r in reps
            if r["state"] == "ready"
        }

    before = wait_for("both replicas ready", lambda: len(ready()) == 2 and ready())
    [agent] = [c for c in steady.fleet.children if c.role == "agent" and c.node == "node-1"]
    [(engine_pid)] = [pid for node, pid in before.values() if node == "node-1"]

    client = SteadyClient(steady.router_url, steady.api_key, "a", max_tokens=8)
    client.start()
    try:
        wait_requests(client, 10, " before the kill")
        os.kill(agent.proc.pid, signal.SIGKILL)
        agent.proc.wait()
        wait_requests(client, 40, " while the agent is gone")  # its engine keeps serving
        assert alive(engine_pid)
        steady.fleet.restart(agent)
        # Same replicas, same engine pids: nothing was restarted.
        wait_for("the engine adopted", lambda: ready() == before)
        wait_requests(client, 10, " after the adoption")
    finally:
        client.stop()
    print(f"model a: {client.ok} requests, {client.rate:.1f}/s, failures: {client.failures}")
    assert client.failures == [] and client.ok > 0
    assert "adopted its running engine" in agent.log.read_text()
    recorded = json.loads((steady.fleet.state_dir / "agents/node-1/shards.json").read_text())
    assert [s["pid"] for s in recorded["shards"].values()] == [engine_pid]


def test_a_steady_node_only_beats_and_reports_at_once_what_changes(tmp_path: Path) -> None:
    """Once its shards are ready and nothing changes, an agent sends heartbeats, not reports;
    a change (a GPU failing) is reported at once, well within the 3 s heartbeat interval: the
    agent gives up the heartbeat the control plane holds."""
    model = {"name": "a", "engine": "sim", "replicas": 1}
    with fleet_of(tmp_path, [model], control_plane={"heartbeat_interval": 3}) as fleet:
        op = Operator(fleet, tmp_path)

        def node() -> dict[str, Any]:
            return next(n for n in op.get("/v1/nodes")["nodes"] if n["name"] == "node-1")

        wait_for("the replica ready", lambda: [r["state"] for r in op.replicas("a")] == ["ready"])
        wait_for("node-1 beating", lambda: node()["heartbeats"] > 0)
        before = node()
        beats = before["heartbeats"] + 1
        wait_for("one more heartbeat of node-1", lambda: node()["heartbeats"] >= beats)
        assert node()["reports"] == before["reports"]  # nothing changed: no report
        free = next(g["index"] for g in node()["gpus"] if not g["in_use"])
        op.gpu("node-1", free, healthy=False, reason="XID 79")

        def reported() -> dict[str, Any] | None:
            n = node()
            return n if n["reports"] > before["reports"] else None

        after = wait_for("node-1 reporting its failed GPU", reported, timeout=2)
        assert not next(g for g in after["gpus"] if g["index"] == free)["healthy"]


@pytest.fixture
def crashing(tmp_path: Path) -> Iterator[RunningFleet]:
    models = [
        {"name": "crashy", "engine": "sim", "args": ["--fault", "exit-at-start"]},
        {
            "name": "stuck",
            "engine": "sim",
            "args": ["--fault", "never-ready"],
            "startup_timeout": 1,
        },
    ]
    with fleet_of(
        tmp_path,
        models,
        agent_args=("--backoff-base", "2", "--backoff-max", "2"),
        control_plane={"max_failures": 3},
    ) as fleet:
        yield fleet


def test_failing_engines_show_backoff_and_log_tail_then_move_elsewhere(
    crashing: RunningFleet, tmp_path: Path
) -> None:
    op = Operator(crashing, tmp_path)
    api = op.admin

    def replica(model: str) -> dict[str, Any] | None:
        reps = [r for r in api.get("/v1/replicas").json()["replicas"] if r["model"] == model]
        return reps[0] if reps else None

    first = wait_for(
        "crashy backing off",
        lambda: (r := replica("crashy")) and r["shards"][0]["backoff_s"] is not None and r,
    )
    shown = op.ctl("replicas", "show", first["id"]).stdout
    assert "after 2s backoff" in shown
    # The engine's last error line is the failure's cause, in the replica and in its event.
    cause = "engine exited (1): RuntimeError: CUDA error: out of memory (simulated fault"
    assert cause in shown
    events = json.loads(op.ctl("events", "-o", "json").stdout)["events"]
    assert any(e["reason"] == "ShardFailed" and cause in e["message"] for e in events)
    full = api.get(f"/v1/replicas/{first['id']}").json()
    assert any("exit-at-start" in line for line in full["shards"][0]["log_tail"])
    # The engine's output on demand, from its node's agent: this run's, and once it has been
    # restarted, the run before's (each start moves the last run's log aside).
    # (Waited for: when the 2 s backoff ends first, this run's log is empty until the engine,
    # started again, writes its last words again.)
    wait_for(
        "the engine's last words from `ctl logs`",
        lambda: "exit-at-start" in op.ctl("logs", first["id"], "--tail", "5").stdout,
    )
    wait_for(
        "crashy restarted",
        lambda: (r := replica("crashy")) and r["shards"][0]["restarts"] >= 1,
    )
    before = op.ctl("logs", first["id"], "--previous", "1", check=False)
    assert "simulated fault: exit-at-start" in before.stdout, before.stderr
    missing = op.ctl("logs", first["id"], "--previous", "9", check=False)
    assert missing.returncode == 1 and "no log of run -9" in missing.stderr, missing.stderr
    # What was written in the last hour (the agent's marks of its logs say where that began).
    recent = op.ctl("logs", first["id"], "--previous", "1", "--since", "1h", check=False)
    assert "simulated fault: exit-at-start" in recent.stdout, recent.stderr
    bad = op.ctl("logs", first["id"], "--since", "lately", check=False)
    assert bad.returncode == 1 and "since:" in bad.stderr, bad.stderr

    # After three failures in a row it is placed on the other node, then kept off both.
    first_node = first["shards"][0]["node"]
    # Seen placed elsewhere, or (a slow machine spent those seconds above) already failed
    # there too and kept off both, which the next wait checks.
    moved = wait_for(
        "crashy placed elsewhere",
        lambda: (
            ((r := replica("crashy")) and r["shards"][0]["node"] != first_node and r)
            or (
                op.ctl("explain-placement", "crashy").stdout.count("avoided") == 2
                and {"kept_off_both": True}
            )
        ),
    )
    assert "kept_off_both" in moved or moved["id"] != first["id"]
    explained = wait_for(
        "crashy kept off both nodes",
        lambda: (
            "avoided" in (s := op.ctl("explain-placement", "crashy").stdout)
            and s.count("avoided") == 2
            and s
        ),
    )
    assert "failed 3 times in a row" in explained

    # "stuck" fails every 3 s; after max_failures on both nodes it is pending, its shards' errors
    # gone, and the reason lives on in why each node is avoided (on a slow machine the checks
    # above outlast all six failures).
    def stuck_error() -> str | None:
        r = replica("stuck")
        if r and r["shards"] and "startup timed out" in r["shards"][0]["error"]:
            return str(r["shards"][0]["error"])
        said = json.dumps(api.get("/v1/explain/stuck").json())
        return "startup timed out after 1s" if "startup timed out after 1s" in said else None

    assert wait_for("stuck timing out", stuck_error) == "startup timed out after 1s"

    # The agents count it all (`GET /metrics` on their admin API), summed over both nodes.
    scraped: dict[tuple[str, str], float] = {}
    for url in crashing.agent_admin.values():
        page = httpx.get(
            url + "/metrics",
            headers={"authorization": f"Bearer {crashing.agent_token}"},
            timeout=10,
        )
        assert page.status_code == 200, page.text
        for family in text_string_to_metric_families(page.text):
            for sample in family.samples:
                key = (sample.name, ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())))
                scraped[key] = scraped.get(key, 0) + sample.value
    assert scraped[("modelfleet_agent_shard_failures_total", "reason=exited")] >= 3
    assert scraped[("modelfleet_agent_shard_failures_total", "reason=startup-timeout")] >= 1
    restarted = sum(
        v for (n, _), v in scraped.items() if n == "modelfleet_agent_shard_restarts_total"
    )
    assert restarted >= 1  # each node restarts a failed engine after its backoff
    assert scraped[("modelfleet_agent_gpu_memory_total_bytes", "gpu=0")] == 2 * 80 * 10**9
    assert scraped[("modelfleet_agent_gpu_healthy", "gpu=0")] == 2
    assert 0 <= scraped[("modelfleet_agent_gpu_utilization_percent", "gpu=0")] <= 200  # 2 nodes
    # Every state has its series, even at a moment when both models are kept off both nodes.
    states = {labels for (n, labels) in scraped if n == "modelfleet_agent_shards"}
    assert states == {f"state={s.value}" for s in ShardState}, states
    refused = httpx.get(next(iter(crashing.agent_admin.values())) + "/metrics", timeout=10)
    assert refused.status_code == 401


def test_a_lost_node_is_replaced_make_before_break(tmp_path: Path) -> None:
    model = {"name": "a", "engine": "sim", "args": ["--itl", "0.02"]}
    options = {"control_plane": {"node_stale_after": 1, "node_lost_after": 2}}
    with fleet_of(tmp_path, [model], **options) as fleet:
        api = Operator(fleet, tmp_path).admin
        [first] = wait_for(
            "a ready",
            lambda: [
                r for r in api.get("/v1/replicas").json()["replicas"] if r["state"] == "ready"
            ],
        )
        node, engine_pid = first["shards"][0]["node"], first["shards"][0]["pid"]
        [agent] = [c for c in fleet.fleet.children if c.role == "agent" and c.node == node]
        client = SteadyClient(fleet.router_url, fleet.api_key, "a", max_tokens=8)
        client.start()
        try:
            os.kill(agent.proc.pid, signal.SIGKILL)  # the node goes silent; its engine serves on
            agent.proc.wait()
            moved = wait_for(
                "a replaced on the other node",
                lambda: [
                    r
                    for r in api.get("/v1/replicas").json()["replicas"]
                    if r["state"] == "ready" and r["shards"][0]["node"] != node
                ],
            )
            wait_for(
                "the lost replica gone",
                lambda: len(api.get("/v1/replicas").json()["replicas"]) == 1,
            )
            wait_requests(client, 10, " after the move")
        finally:
            client.stop()
        print(f"model a: {client.ok} requests, failures: {client.failures}")
        assert client.failures == [] and client.ok > 0 and moved[0]["id"] != first["id"]
        # The node comes back: its agent adopts the old engine, finds it unassigned, stops it.
        assert alive(engine_pid)
        fleet.fleet.restart(agent)
        wait_for("the old engine stopped", lambda: not alive(engine_pid))


def test_a_node_gone_for_good_is_deleted_or_forgotten(tmp_path: Path) -> None:
    """`ctl nodes delete` refuses a node that holds replicas, unless --force, which places them
    anew elsewhere. A node silent for node_forget_after with nothing on it is forgotten."""
    model = {"name": "a", "engine": "sim"}
    options = {
        "gpus": "1x80GB",
        "nodes": ("node-1", "node-2", "node-3"),
        "control_plane": {"node_stale_after": 1, "node_lost_after": 60, "node_forget_after": 60},
    }
    with fleet_of(tmp_path, [model], **options) as fleet:
        op = Operator(fleet, tmp_path)
        [first] = wait_for(
            "a ready", lambda: [r for r in op.replicas("a") if r["state"] == "ready"]
        )
        holder = first["shards"][0]["node"]
        [agent] = [c for c in fleet.fleet.children if c.role == "agent" and c.node == holder]
        os.kill(agent.proc.pid, signal.SIGKILL)  # the machine is gone for good
        agent.proc.wait()

        refused = op.ctl("nodes", "delete", holder, check=False)
        assert refused.returncode == 1 and "drain it first" in refused.stderr
        done = op.ctl("nodes", "delete", holder, "--force")
        assert f"node {holder} deleted; placed anew elsewhere: {first['id']}" in done.stdout
        wait_for(
            "a ready on another node",
            lambda: [
                r
                for r in op.replicas("a")
                if r["state"] == "ready" and r["shards"][0]["node"] != holder
            ],
        )
        names = [n["name"] for n in op.get("/v1/nodes")["nodes"]]
        assert holder not in names and len(names) == 2


def test_when_every_agent_goes_silent_nothing_moves_and_ctl_says_why(tmp_path: Path) -> None:
    model = {"name": "a", "engine": "sim", "replicas": 2}
    options = {"control_plane": {"node_stale_after": 1, "node_lost_after": 2}}
    with fleet_of(tmp_path, [model], **options) as fleet:
        op = Operator(fleet, tmp_path)
        wait_for("a ready twice", lambda: [r["state"] for r in op.replicas("a")] == ["ready"] * 2)
        before = sorted(r["id"] for r in op.replicas("a"))
        agents = [c for c in fleet.fleet.children if c.role == "agent"]
        for agent in agents:  # the network to every node fails at once
            os.kill(agent.proc.pid, signal.SIGSTOP)
        try:
            shown = wait_for(
                "ctl status to say every node is silent",
                lambda: "every node has been silent" in (s := op.ctl("status").stdout) and s,
            )
            assert "nothing is moved" in shown
            assert "every node has been silent" in op.ctl("nodes").stdout
            op.wait_passes(3)
            assert sorted(r["id"] for r in op.replicas("a")) == before  # nothing moved
        finally:
            for agent in agents:
                os.kill(agent.proc.pid, signal.SIGCONT)
        wait_for("the freeze lifted", lambda: op.get("/v1/status")["frozen"] == "")
        wait_for(
            "a ready twice again", lambda: [r["state"] for r in op.replicas("a")] == ["ready"] * 2
        )
        assert sorted(r["id"] for r in op.replicas("a")) == before


def test_a_replica_of_two_shards_is_restarted_as_one_when_a_shard_dies(tmp_path: Path) -> None:
    """Rank 1's engine killed: the replica leaves every router's table (a table without it
    confirmed by the router) within 5 s, both shards are started again, rank 0 first, and it
    serves again; `ctl replicas show` says which shard failed and why."""
    with fleet_of(tmp_path, [{"name": "wide", "engine": "sim", "shards": 2}]) as fleet:
        op = Operator(fleet, tmp_path)

        def serving() -> dict[str, Any] | None:
            found = [r for r in op.replicas("wide") if r["state"] == "ready"]
            return found[0] if found else None

        before = wait_for("the 2-shard replica to serve", serving)
        pids = [s["pid"] for s in before["shards"]]
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()

        def unrouted() -> bool:
            table = op.get("/v1/routing")
            gone = not next(m["endpoints"] for m in table["models"] if m["name"] == "wide")
            return gone and all(v >= table["version"] for v in table["routers"].values())

        wait_for("every router to hold a table without the replica", unrouted, timeout=5)
        print(f"out of every router's table {time.monotonic() - killed:.2f}s after the kill")
        after = wait_for(
            "the replica to serve again with both shards new",
            lambda: (r := serving()) and all(s["pid"] not in pids for s in r["shards"]) and r,
            timeout=30,
        )
        assert after["id"] == before["id"] and after["generation"] == 1
        started = [psutil.Process(s["pid"]).create_time() for s in after["shards"]]
        assert started[0] <= started[1], "rank 1 started before rank 0"
        assert after["last_failure"].startswith(f"shard 1 on {after['shards'][1]['node']} failed")
        assert "engine exited" in after["last_failure"]
        assert not alive(pids[0])  # rank 0 was stopped too, not left alone
        wait_for("the router to serve wide again", lambda: op.serves("wide"))
        told = op.get(f"/v1/events?for=replica/{before['id']}")["events"]
        restarted = [e for e in told if e["reason"] == "ShardsRestarted"]
        assert len(restarted) == 1 and "shard 1 on" in restarted[0]["message"]
        assert any(e["reason"] == "ShardFailed" for e in told)


def test_an_agent_republishes_its_engines_metrics_under_one_set_of_names(
    steady: RunningFleet, tmp_path: Path
) -> None:
    """Each agent's /metrics carries what its ready engines say of themselves (the simulator
    speaks vLLM's names) as modelfleet_engine_*, labelled with model, replica and node."""
    op = Operator(steady, tmp_path)
    ready = wait_for(
        "both replicas of a ready",
        lambda: len(r := [x for x in op.replicas("a") if x["state"] == "ready"]) == 2 and r,
    )
    assert op.serves("a")  # one request, for the prefix cache's counts
    seen: dict[str, str] = {}
    for node, url in steady.agent_admin.items():
        page = httpx.get(
            url + "/metrics",
            headers={"authorization": f"Bearer {steady.agent_token}"},
            timeout=10,
        ).text
        for family in text_string_to_metric_families(page):
            for sample in family.samples:
                if sample.name == "modelfleet_engine_requests_running":
                    assert sample.labels["node"] == node and sample.labels["model"] == "a"
                    seen[sample.labels["replica"]] = node
    assert seen == {r["id"]: r["shards"][0]["node"] for r in ready}
