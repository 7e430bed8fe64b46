"""Heartbeats: when an agent beats instead of reporting, how the control plane holds a beat
until the node's assignment changes (in-process, ASGI transport), how the interval grows with
the fleet, and that a reconcile pass plans only when something it plans from changed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import yaml

from modelfleet.agent.gpus import SimulatedGpus
from modelfleet.agent.heartbeat import MEMORY_DRIFT, needs_report, retry_delay
from modelfleet.agent.uplink import describe
from modelfleet.controlplane.agent_api import create_agent_app
from modelfleet.controlplane.catalogs import CatalogKeeper
from modelfleet.controlplane.config import ControlPlaneConfig, Heartbeats
from modelfleet.controlplane.leadership import Turn
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.controlplane.watch import AssignmentWatch
from modelfleet.messages.wire import (
    AgentReport,
    Heartbeat,
    HeartbeatAnswer,
    NodeAssignment,
    ShardReport,
    ShardState,
)
from modelfleet.store.sqlite import SqliteStore

TOKEN = "admin-token-123"
GPUS = SimulatedGpus("2x80GB")


def keeper(models: list[dict[str, Any]]) -> CatalogKeeper:
    k = CatalogKeeper(SqliteStore(":memory:"))
    k.lead(0.0)
    k.apply(yaml.safe_dump({"models": models}), "api", 0.0)
    return k


def report(node: str, seq: int = 1, boot: str = "b", **changes: Any) -> AgentReport:
    fields: dict[str, Any] = {"node": node, "boot_id": boot, "seq": seq,
                              "address": "10.0.0.1", "gpus": GPUS.gpus(), "shards": []}  # fmt: skip
    return AgentReport(**{**fields, **changes})


# -- when an agent reports ------------------------------------------------------------------


def test_an_agent_reports_what_changed_and_beats_otherwise() -> None:
    taken = report("n", seq=1)
    assert needs_report(None, taken)  # nothing taken yet
    assert not needs_report(taken, report("n", seq=7))  # only the count moved on
    assert needs_report(taken, report("n", seq=7, boot="other"))
    assert needs_report(taken, report("n", seq=2, labels={"zone": "b"}))
    shard = ShardReport(replica_id="r", model="m", rank=0, num_shards=1, gpus=[0],
                        engine_digest="d", state=ShardState.READY, port=9000)  # fmt: skip
    assert needs_report(taken, report("n", seq=2, shards=[shard]))
    drift = [g.model_copy(update={"memory_used": g.memory_used + (1 << 20)}) for g in GPUS.gpus()]
    assert not needs_report(taken, report("n", seq=2, gpus=drift))  # a MiB of drift: no
    busy = [g.model_copy(update={"utilization": 87.5}) for g in GPUS.gpus()]
    assert not needs_report(taken, report("n", seq=2, gpus=busy))  # heartbeats carry it
    moved = [g.model_copy(update={"memory_used": MEMORY_DRIFT + 1}) for g in GPUS.gpus()]
    assert needs_report(taken, report("n", seq=2, gpus=moved))
    failed = [g.model_copy(update={"healthy": False, "reason": "XID 79"}) for g in GPUS.gpus()]
    assert needs_report(taken, report("n", seq=2, gpus=failed))
    assert needs_report(taken, report("n", seq=2, gpus=GPUS.gpus()[:1]))


def test_agents_try_again_spread_over_the_interval() -> None:
    """Agents that failed together (their control plane stopped) do not all come back at once:
    each waits the interval moved by up to 20 % either way."""
    assert retry_delay(2.0, 0.0) == pytest.approx(1.6)
    assert retry_delay(2.0, 0.5) == pytest.approx(2.0)
    assert retry_delay(2.0, 0.999) == pytest.approx(2.4, abs=0.01)
    delays = {round(retry_delay(2.0, i / 100), 3) for i in range(100)}
    assert len(delays) == 100 and min(delays) >= 1.6 and max(delays) < 2.4


# -- the watch ------------------------------------------------------------------------------


def test_the_watch_wakes_the_node_notified_and_times_out_the_others() -> None:
    async def go() -> None:
        watch = AssignmentWatch()
        woken = asyncio.ensure_future(watch.wait("a", 30))
        other = asyncio.ensure_future(watch.wait("b", 0.05))
        await asyncio.sleep(0)
        assert watch.waiting() == 2
        watch.notify(["a", "c"])
        assert await asyncio.wait_for(woken, 5) is True
        assert await asyncio.wait_for(other, 5) is False  # its timeout, not a's notice
        assert watch.waiting() == 0

        held = asyncio.ensure_future(watch.wait("a", 30))
        await asyncio.sleep(0)
        watch.close()
        assert await asyncio.wait_for(held, 5) is False
        assert await asyncio.wait_for(watch.wait("a", 30), 5) is False  # closed: held no more

    asyncio.run(go())


# -- the interval grows with the fleet ------------------------------------------------------


def test_the_heartbeat_interval_stretches_with_the_fleet_and_the_silences_with_it() -> None:
    config = ControlPlaneConfig(admin_token=TOKEN)
    assert config.heartbeats(10) == Heartbeats(2.0, 10.0, 60.0)
    assert config.heartbeats(10_000) == Heartbeats(10.0, 30.0, 60.0)
    assert config.heartbeats(100_000) == Heartbeats(100.0, 300.0, 600.0)
    custom = ControlPlaneConfig(admin_token=TOKEN, heartbeat_interval=0.5, max_heartbeats_per_s=50)
    assert custom.heartbeats(100) == Heartbeats(2.0, 10.0, 60.0)


# -- the agent API --------------------------------------------------------------------------


def with_api(
    config: ControlPlaneConfig,
    models: list[dict[str, Any]],
    test: Callable[[ControlPlane, httpx.AsyncClient], Awaitable[None]],
) -> None:
    # Requests carry no token: the API is left open, unless the config has a shared token.
    cp = ControlPlane(config.model_copy(update={"insecure_agent_api": True}), keeper(models))

    async def go() -> None:
        transport = httpx.ASGITransport(app=create_agent_app(cp))
        async with httpx.AsyncClient(transport=transport, base_url="http://cp") as client:
            await test(cp, client)

    asyncio.run(go())


async def send_report(client: httpx.AsyncClient, sent: AgentReport) -> NodeAssignment:
    response = await client.post("/v1/report", content=sent.model_dump_json())
    assert response.status_code == 200, response.text
    return NodeAssignment.model_validate_json(response.content)


async def beat(
    client: httpx.AsyncClient, seq: int, version: str, node: str = "n", boot: str = "b"
) -> httpx.Response:
    sent = Heartbeat(node=node, boot_id=boot, seq=seq, assignment=version)
    return await client.post("/v1/heartbeat", content=sent.model_dump_json())


def test_a_heartbeat_is_held_for_the_interval_when_its_assignment_is_current() -> None:
    config = ControlPlaneConfig(admin_token=TOKEN, settle_for=-1, heartbeat_interval=0.3)

    async def test(cp: ControlPlane, client: httpx.AsyncClient) -> None:
        held = await send_report(client, report("n"))
        assert held.version and held.heartbeat_interval == 0.3
        began = time.monotonic()
        response = await beat(client, 2, held.version)
        took = time.monotonic() - began
        answer = HeartbeatAnswer.model_validate_json(response.content)
        assert answer.assignment is None and answer.heartbeat_interval == 0.3
        # Held for 75 to 100 % of the interval, so that agents do not beat in step.
        assert took >= 0.22, f"answered after {took:.3f}s: not held for the interval"
        assert cp.state.nodes["n"].beats == 1 and cp.state.nodes["n"].seq == 2

        # An agent holding another assignment gets the current one at once.
        response = await beat(client, 3, "another")
        answer = HeartbeatAnswer.model_validate_json(response.content)
        assert answer.assignment is not None and answer.assignment.version == held.version

    with_api(config, [{"name": "m", "engine": "sim"}], test)


def test_a_held_heartbeat_is_answered_as_soon_as_a_pass_assigns_its_node() -> None:
    config = ControlPlaneConfig(admin_token=TOKEN, settle_for=-1, heartbeat_interval=30)

    async def test(cp: ControlPlane, client: httpx.AsyncClient) -> None:
        held = await send_report(client, report("n"))
        assert held.shards == []  # no pass yet
        waiting = asyncio.ensure_future(beat(client, 2, held.version))
        deadline = time.monotonic() + 5
        while cp.watch.waiting() == 0:  # the beat is held
            assert time.monotonic() < deadline, "the heartbeat was never held"
            await asyncio.sleep(0.01)
        cp.reconcile_once(time.monotonic())
        cp.notify_assignments()
        response = await asyncio.wait_for(waiting, 5)  # not the 30 s interval
        answer = HeartbeatAnswer.model_validate_json(response.content)
        assert answer.assignment is not None
        assert [s.model for s in answer.assignment.shards] == ["m"]

        # A control plane that stops answers what it holds at once, and says so.
        waiting = asyncio.ensure_future(beat(client, 3, answer.assignment.version))
        while cp.watch.waiting() == 0:
            assert time.monotonic() < deadline, "the heartbeat was never held"
            await asyncio.sleep(0.01)
        cp.watch.close()
        response = await asyncio.wait_for(waiting, 5)
        assert response.status_code == 503 and "stopping" in response.text  # the agent waits

    with_api(config, [{"name": "m", "engine": "sim"}], test)


def test_a_heartbeat_the_control_plane_cannot_place_asks_for_the_whole_report() -> None:
    config = ControlPlaneConfig(admin_token=TOKEN, settle_for=-1, heartbeat_interval=0.1)

    async def test(cp: ControlPlane, client: httpx.AsyncClient) -> None:
        unknown = await beat(client, 1, "v")
        assert unknown.status_code == 409 and "send the whole report" in unknown.text
        held = await send_report(client, report("n", seq=5))
        rebooted = await beat(client, 6, held.version, boot="new-run")
        assert rebooted.status_code == 409 and "new-run" in rebooted.text
        old = await beat(client, 5, held.version)
        assert old.status_code == 409 and "not newer than 5" in old.text
        bad = await client.post("/v1/heartbeat", content=b'{"node": "n"}')
        assert bad.status_code == 400 and "malformed heartbeat" in bad.text
        assert cp.state.nodes["n"].beats == 0  # none of them was taken

    with_api(config, [], test)


# -- a pass plans only when there is something new ------------------------------------------


@pytest.fixture
def fleet() -> ControlPlane:
    """Two nodes, one replica on one of them, reported at 0."""
    config = ControlPlaneConfig(admin_token=TOKEN, settle_for=-1, reconcile_full_interval=30)
    cp = ControlPlane(config, keeper([{"name": "m", "engine": "sim", "gpus_per_shard": 2}]))
    for node in ("n1", "n2"):
        cp.state.take_report(report(node), cp.catalogs.current, 0.0)
    cp.reconcile_once(0.0)
    return cp


def test_a_pass_with_nothing_new_plans_nothing_until_the_full_pass(fleet: ControlPlane) -> None:
    cp = fleet
    cp.reconcile_once(0.5)  # the replica placed at 0 is new to plan from: once more
    plans = cp.plans
    for now in (1.0, 2.0, 5.0, 9.0):
        cp.reconcile_once(now)
    assert cp.plans == plans and cp.passes == plans + 4
    for n, node in enumerate(("n1", "n2"), start=2):
        cp.state.take_report(report(node, seq=n, labels={"zone": "a"}), cp.catalogs.current, 9.5)
    cp.reconcile_once(9.6)  # two changed reports: one pass plans
    assert cp.plans == plans + 1
    seq = 4
    for now in range(10, 29, 2):  # both nodes beat; nothing else happens
        for node in ("n1", "n2"):
            seq += 1
            cp.state.take_heartbeat(Heartbeat(node=node, boot_id="b", seq=seq, assignment=""), now)
        cp.reconcile_once(now + 0.5)
    cp.reconcile_once(29.9)
    assert cp.plans == plans + 1
    cp.reconcile_once(30.0)  # 30 s after the pass that planned the whole fleet: the safety net
    assert cp.plans == plans + 2


def test_a_node_going_lost_with_nothing_else_new_is_planned_for(fleet: ControlPlane) -> None:
    cp = fleet
    [holder] = {s.node for r in cp.state.replicas.values() for s in r.replica.shards}
    beater = "n2" if holder == "n1" else "n1"
    cp.reconcile_once(0.5)
    plans, replaced_at = cp.plans, None
    for seq, now in enumerate(range(2, 66, 2), start=2):
        cp.state.take_heartbeat(Heartbeat(node=beater, boot_id="b", seq=seq, assignment=""), now)
        cp.reconcile_once(now + 0.5)
        if replaced_at is None and any(
            s.node == beater for r in cp.state.replicas.values() for s in r.replica.shards
        ):
            replaced_at = now + 0.5
    # The holder goes stale at 10 and lost at 60: the first passes a reconcile interval (1 s)
    # after those plan (and the 30 s safety net between them), and the one after 61 places the
    # replacement on the node that beats.
    assert replaced_at == 62.5
    assert cp.plans - plans <= 5, f"{cp.plans - plans} passes planned"


def test_the_bare_agent_api_checks_token_size_method_and_path() -> None:
    config = ControlPlaneConfig(admin_token=TOKEN, agent_token="agent-token-0123456789")

    async def test(cp: ControlPlane, client: httpx.AsyncClient) -> None:
        unsigned = await beat(client, 1, "v")
        assert unsigned.status_code == 401 and "wrong agent token" in unsigned.json()["error"]
        signed = {"authorization": "Bearer agent-token-0123456789"}
        huge = await client.post("/v1/heartbeat", content=b"x" * 5000, headers=signed)
        assert huge.status_code == 413 and "4096 bytes" in huge.json()["error"]
        assert (await client.get("/v1/heartbeat", headers=signed)).status_code == 405
        assert (await client.post("/v1/elsewhere", headers=signed)).status_code == 404
        assert (await client.post("/v1/report", content=b"{}", headers=signed)).status_code == 400

    with_api(config, [], test)


def test_a_change_for_one_model_plans_that_model_only() -> None:
    """A report that changes what one model's replica does plans that model, not the fleet;
    a node that comes plans every model."""
    models = [{"name": m, "engine": "sim", "node_labels": {"zone": m}} for m in "ab"]
    cp = ControlPlane(ControlPlaneConfig(admin_token=TOKEN, settle_for=-1), keeper(models))
    for node, zone in (("n1", "a"), ("n2", "b")):
        cp.state.take_report(report(node, labels={"zone": zone}), cp.catalogs.current, 0.0)
    cp.reconcile_once(0.0)
    assert cp.term.planned_models == 2  # the first pass plans everything
    cp.reconcile_once(0.5)  # the replicas it placed are new to plan from: planned once more
    [on_n1] = [r.replica for r in cp.state.replicas.values() if r.replica.shards[0].node == "n1"]
    assigned = cp.assignments.of("n1", cp.catalogs.current).shards
    failed = ShardReport.of(assigned[0], ShardState.FAILED, failures=3, error="exit 1")
    sent = report("n1", seq=2, labels={"zone": "a"}, shards=[failed])
    cp.state.take_report(sent, cp.catalogs.current, 1.0)
    plans = cp.plans
    cp.reconcile_once(1.0)
    assert cp.plans == plans + 1 and cp.term.planned_models == 1  # model a only
    assert cp.state.replicas[on_n1.id].retiring.startswith("failed 3 times")
    cp.state.take_report(report("n3", labels={"zone": "b"}), cp.catalogs.current, 2.0)
    cp.reconcile_once(2.0)
    assert cp.term.planned_models == 2  # a node came: every model may use it


def test_settling_ends_when_every_known_node_reported_or_the_window_closes() -> None:
    """After a start, nothing is planned until every node the config names has reported, or
    the settle window (here 10 s) is over; a node it does not name does not end it."""
    config = ControlPlaneConfig(admin_token=TOKEN, known_nodes=["n1", "n2"], settle_for=10)
    cp = ControlPlane(config, keeper([{"name": "m", "engine": "sim"}]))
    start = cp.term.started_at
    cp.state.take_report(report("n1"), cp.catalogs.current, start)
    cp.state.take_report(report("stranger"), cp.catalogs.current, start)
    assert cp.settling(start + 1)  # two reported, but not both of the known ones
    cp.reconcile_once(start + 1)
    assert cp.plans == 0
    cp.state.take_report(report("n2"), cp.catalogs.current, start + 2)
    assert not cp.settling(start + 2)
    cp.reconcile_once(start + 2)
    assert cp.plans == 1

    alone = ControlPlane(config, keeper([{"name": "m", "engine": "sim"}]))
    alone.state.take_report(report("n1"), alone.catalogs.current, alone.term.started_at)
    assert alone.settling(alone.term.started_at + 9.9)
    assert not alone.settling(alone.term.started_at + 10)  # the window is over


def test_a_failed_exchange_is_described_never_as_nothing() -> None:
    """The agent once logged "heartbeat failed:" and nothing more on a timeout."""
    assert describe(httpx.ReadTimeout("")) == "no answer in time (ReadTimeout)"
    assert describe(httpx.ConnectError("refused")) == "ConnectError: refused"
    assert describe(httpx.RemoteProtocolError("")) == "RemoteProtocolError"


@pytest.mark.parametrize("how", ["heartbeat", "report"])
def test_a_stale_node_heard_from_again_is_planned_for_at_once(how: str) -> None:
    """A model added while the only node was stale waits; the node's next heartbeat (or
    report) makes the next pass plan, and place it there, not the 30 s safety net. A
    mutation that dropped this survived every test."""
    models = [{"name": "a", "engine": "sim"}]
    cp = ControlPlane(ControlPlaneConfig(admin_token=TOKEN, settle_for=-1), keeper(models))
    cp.state.take_report(report("n1"), cp.catalogs.current, 0.0)
    cp.reconcile_once(0.0)
    cp.reconcile_once(0.5)
    more = yaml.safe_dump({"models": [*models, {"name": "b", "engine": "sim"}]})
    cp.catalogs.apply(more, "api", 20.0)
    cp.reconcile_once(20.0)  # n1 has been silent 20 s: stale, nothing lands on it
    assert [p.model for p in cp.state.pending] == ["b"]
    plans = cp.plans
    cp.reconcile_once(20.5)
    assert cp.plans == plans  # nothing new to plan from
    if how == "heartbeat":
        heard = cp.state.take_heartbeat(
            Heartbeat(node="n1", boot_id="b", seq=2, assignment=""), 21.0
        )
    else:
        heard = cp.state.take_report(report("n1", seq=2), cp.catalogs.current, 21.0)
    assert heard  # something the planner looks at changed
    cp.reconcile_once(21.5)
    assert cp.plans == plans + 1
    assert cp.state.pending == [] or all(p.count == 0 for p in cp.state.pending)
    placed = {r.replica.model for r in cp.state.replicas.values()}
    assert placed == {"a", "b"}


def test_a_leader_that_lost_its_lease_while_holding_a_heartbeat_answers_that_it_follows() -> None:
    """M25: a heartbeat is held up to the interval; a leader that lost its lease meanwhile
    must not answer it with an assignment (of the epoch it led under), but send the agent on:
    it no longer leads."""
    config = ControlPlaneConfig(admin_token=TOKEN, settle_for=-1, heartbeat_interval=1.0)

    async def test(cp: ControlPlane, client: httpx.AsyncClient) -> None:
        held = await send_report(client, report("n"))
        waiting = asyncio.ensure_future(beat(client, 2, held.version))
        deadline = time.monotonic() + 5
        while cp.watch.waiting() == 0:  # the beat is held
            assert time.monotonic() < deadline, "the heartbeat was never held"
            await asyncio.sleep(0.01)
        cp.store.release_lease(cp.leadership.holder)  # as if it ran out, and another took it
        assert cp.store.take_lease("another", 30.0).holder == "another"
        assert await cp.renew_lease() is Turn.LOST
        response = await asyncio.wait_for(waiting, 5)  # held to the end of the interval
        assert response.status_code in (307, 503), response.text
        assert "this control plane follows; the leader is another" in response.text

    with_api(config, [{"name": "m", "engine": "sim"}], test)
