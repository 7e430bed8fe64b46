"""The fleet's events (`controlplane/events.py`): what the control plane records as it
happens, and what `GET /v1/events` and `ctl events` answer."""

from __future__ import annotations

import asyncio
import io
import time

import httpx
import yaml
from rich.console import Console

from modelfleet.agent.gpus import SimulatedGpus
from modelfleet.controlplane import nodes
from modelfleet.controlplane.catalog_file import applied_event
from modelfleet.controlplane.config import ControlPlaneConfig, RouterTarget
from modelfleet.controlplane.events import EventLog
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.controlplane.service import create_apps
from modelfleet.core.fleet import Mark
from modelfleet.ctl.render import print_events
from modelfleet.messages.admin import EventsAnswer
from modelfleet.messages.wire import ROUTER_RUN_HEADER, AgentReport, ShardReport, ShardState
from modelfleet.store.sqlite import SqliteStore

from .test_admin_api import TOKEN, control_plane


def test_a_repeat_counts_up_and_the_oldest_go_past_the_bound() -> None:
    store = SqliteStore(":memory:")
    clock = iter(range(100, 200))
    log = EventLog(store, lambda: float(next(clock)), keep=3)
    log.warning("PushFailed", "router/r1", "unreachable")
    log.warning("PushFailed", "router/r1", "unreachable")
    log.normal("PushConfirmed", "router/r1", "version 3")
    log.warning("PushFailed", "router/r1", "unreachable")  # not the last about r1: new
    log.flush()  # what a control plane's writer does (`EventLog.run`), off its event loop
    [first, *_] = store.events()
    assert (first.reason, first.count, first.first_at, first.last_at) == ("PushFailed", 2, 100, 101)
    log.normal("NodeMarked", "node/a", "cordoned")
    log.normal("NodeMarked", "node/b", "cordoned")
    log.flush()
    kept = store.events()
    assert [e.regarding for e in kept] == ["router/r1", "node/a", "node/b"]  # 3 kept
    assert [e.regarding for e in store.events("node")] == ["node/a", "node/b"]
    assert [e.regarding for e in store.events("node/b")] == ["node/b"]
    assert store.events(after=kept[-1].id) == []


def test_changes_and_faults_are_events_an_operator_can_read() -> None:
    cp = control_plane()  # nodes a and b, a replica of small ready on a
    catalog = cp.catalogs.current
    asyncio.run(nodes.set_mark(cp, "b", Mark.CORDONED, 0))
    [(rid, _)] = list(cp.state.nodes["a"].shards)
    gpus = SimulatedGpus("2x80GB", {1: "XID 79"})
    assignment = next(a for a in cp.assignments.of("a", catalog).shards if a.replica_id == rid)
    failed = ShardReport.of(assignment, ShardState.FAILED, error="engine exited (1)", failures=1)
    report = AgentReport(node="a", boot_id="b", seq=3, address="127.0.0.1", gpus=gpus.gpus(),
                         shards=[failed])  # fmt: skip
    cp.state.take_report(report, catalog, cp.clock.monotonic())
    cp.record_news()
    applied = cp.catalogs.apply(
        yaml.safe_dump({"models": [{"name": "small", "engine": "sim", "replicas": 3}]}),
        "api",
        cp.clock.time(),
    )
    applied_event(cp.events, applied, "api")
    _, admin_app = create_apps(cp)

    async def go() -> EventsAnswer:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=admin_app),
            base_url="http://cp",
            headers={"authorization": f"Bearer {TOKEN}"},
        ) as admin:
            one = await admin.get("/v1/events", params={"for": f"replica/{rid}"})
            assert [e["reason"] for e in one.json()["events"]][-1] == "ShardFailed"
            every = await admin.get("/v1/events")
            return EventsAnswer.model_validate_json(every.content)

    answer = asyncio.run(go())
    seen = {(e.reason, e.regarding): e for e in answer.events}
    assert seen[("NodeMarked", "node/b")].message == "marked cordoned (was none)"
    assert seen[("ShardFailed", f"replica/{rid}")].message == "shard 0 on a: engine exited (1)"
    assert seen[("ShardFailed", f"replica/{rid}")].type == "warning"
    assert ("NodeReported", "node/a") in seen
    # Where it went, and why: the count it fills and the placement rule that chose the node.
    assert seen[("ReplicaPlaced", f"replica/{rid}")].message == (
        "small on a[0]: 2 wanted, 0 up to date; "
        "spread: the node with the fewest of its replicas, then the most free GPUs"
    )
    catalog_event = seen[("CatalogApplied", f"catalog/{applied.catalog.version}")]
    assert catalog_event.message == "from api: -wide ~small"
    shown = io.StringIO()
    print_events(answer, Console(file=shown, width=200))
    assert "ShardFailed" in shown.getvalue() and "engine exited (1)" in shown.getvalue()


def test_a_drain_of_an_empty_node_is_told_once() -> None:
    cp = control_plane()
    empty = AgentReport(node="c", boot_id="b", seq=1, address="127.0.0.1", gpus=[], shards=[])
    cp.state.take_report(empty, cp.catalogs.current, cp.clock.monotonic())
    asyncio.run(nodes.set_mark(cp, "c", Mark.DRAINING, 0))
    cp.reconcile_once(cp.clock.monotonic())
    cp.replan()
    cp.reconcile_once(cp.clock.monotonic())  # told once per drain
    drained = [e for e in cp.read_events("node/c") if e.reason == "NodeDrained"]
    assert len(drained) == 1 and drained[0].count == 1


def test_the_release_that_empties_a_draining_node_tells_it_drained_without_another_pass() -> None:
    cp = control_plane()  # a and b each hold a replica of `small` on their one healthy GPU
    now = time.monotonic()
    [on_b] = cp.assignments.of("b", cp.catalogs.current).shards
    b = cp.state.nodes["b"].report
    b_ready = ShardReport.of(on_b, ShardState.READY, port=9000, pid=123)
    cp.state.take_report(
        b.model_copy(update={"seq": 2, "shards": [b_ready]}), cp.catalogs.current, now
    )
    gpus = SimulatedGpus("1x80GB", {}).gpus()
    room = AgentReport(node="c", boot_id="b", seq=1, address="127.0.0.1", gpus=gpus, shards=[])
    cp.state.take_report(room, cp.catalogs.current, now)
    asyncio.run(nodes.set_mark(cp, "a", Mark.DRAINING, 600))
    cp.reconcile_once(now)  # a's replacement is placed on c
    [placed] = cp.assignments.of("c", cp.catalogs.current).shards
    ready = ShardReport.of(placed, ShardState.READY, port=9001, pid=124)
    serving = room.model_copy(update={"seq": 2, "shards": [ready]})
    cp.state.take_report(serving, cp.catalogs.current, now)
    cp.reconcile_once(now)  # the replacement serves: the replica on a retires
    cp.publish()
    cp.release_retired(now)  # no router to wait for: released, and node a is empty
    assert not cp.state.on_node("a")
    drained = [e for e in cp.read_events("node/a") if e.reason == "NodeDrained"]
    assert len(drained) == 1


def test_a_push_a_router_missed_is_an_event() -> None:
    cp = control_plane()
    answers = iter([httpx.Response(500, text="down"), httpx.Response(500, text="down")])
    publisher = cp.publisher
    router = RouterTarget(url="http://r1", token="t")

    async def go() -> None:
        def answer(request: httpx.Request) -> httpx.Response:
            held = {"applied": True, "epoch": publisher.epoch, "version": publisher.version}
            return next(answers, httpx.Response(200, json=held))

        publisher._http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        publisher.routers = [router]
        publisher.publish(1, [], [])
        await publisher._push(router)
        await publisher._push(router)
        await publisher._push(router)

    asyncio.run(go())
    told = cp.read_events("router/http://r1")
    assert [(e.reason, e.count) for e in told] == [("PushMissed", 2), ("PushConfirmed", 1)]

    # A router found unreachable by a check (killed, say) is told once per spell.
    down = [True, True]

    async def checks() -> None:
        def answer(request: httpx.Request) -> httpx.Response:
            if down and down.pop():
                raise httpx.ConnectError("refused", request=request)
            held = {"applied": True, "epoch": publisher.epoch, "version": publisher.version}
            return httpx.Response(200, json=held)

        publisher._http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        r2 = RouterTarget(url="http://r2", token="t")
        for _ in range(3):
            await publisher.check(r2)

    asyncio.run(checks())
    told = cp.read_events("router/http://r2")
    assert [(e.reason, e.count) for e in told] == [("PushMissed", 1), ("PushConfirmed", 1)]
    assert "unreachable: ConnectError" in told[0].message


def test_a_router_restarted_between_two_checks_is_an_event() -> None:
    """Issue 57 (bench/faults.py's events_per_fault false in one run of two): a killed router
    that restores its table file was back before the next check, so no check found it down,
    and its restart left no event. Its answers name the run of it that gives them."""
    cp = control_plane()
    publisher = cp.publisher
    router = RouterTarget(url="http://r1", token="t")
    runs = iter(["run-1", "run-1", "run-2", "run-2"])

    async def go() -> None:
        def answer(request: httpx.Request) -> httpx.Response:
            held = {"applied": True, "epoch": publisher.epoch, "version": publisher.version}
            return httpx.Response(200, json=held, headers={ROUTER_RUN_HEADER: next(runs)})

        publisher._http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        publisher.routers = [router]
        publisher.publish(1, [], [])
        await publisher._push(router)  # the first heard of it: no news
        await publisher.check(router)
        await publisher.check(router)  # a new run, holding the current table (restored)
        await publisher.check(router)

    asyncio.run(go())
    told = [(e.reason, e.message) for e in cp.read_events("router/http://r1")]
    assert told == [
        (
            "RouterRestarted",
            f"a new run of it, that holds version ({publisher.epoch}, {publisher.version})",
        )
    ]


def test_a_control_plane_start_and_an_agent_run_anew_are_events() -> None:
    cp = control_plane()  # nodes a and b reported by agent run "b"
    elected, started = cp.read_events("control-plane")
    assert elected.reason == "LeaderElected"
    assert elected.message == "leads under epoch 1: the first to lead on this store"
    assert started.reason == "ControlPlaneStarted"
    assert started.message.startswith("leading, routing epoch 1, catalog version")
    again = AgentReport(node="a", boot_id="other-run", seq=1, address="127.0.0.1", gpus=[],
                        shards=[])  # fmt: skip
    cp.state.take_report(again, cp.catalogs.current, cp.clock.monotonic())
    cp.record_news()
    told = [e for e in cp.read_events("node/a") if e.reason == "AgentRestarted"]
    assert len(told) == 1 and told[0].message == "a new agent run, 0 shard(s) held"


def test_an_engine_restarted_between_two_reports_is_an_event_with_its_cause() -> None:
    """The agent restarted the engine so fast that no report said failed: the restart count
    tells the control plane, and the report keeps why."""
    cp = control_plane()  # a replica of small ready on a
    catalog = cp.catalogs.current
    [(rid, _)] = list(cp.state.nodes["a"].shards)
    assignment = next(a for a in cp.assignments.of("a", catalog).shards if a.replica_id == rid)
    gpus = SimulatedGpus("2x80GB", {1: "XID 79"}).gpus()
    again = ShardReport.of(
        assignment, ShardState.READY, port=9000, restarts=1, last_failure="exited: exit code -9"
    )
    report = AgentReport(node="a", boot_id="b", seq=3, address="127.0.0.1", gpus=gpus,
                         shards=[again])  # fmt: skip
    cp.state.take_report(report, catalog, cp.clock.monotonic())
    cp.record_news()
    [restarted] = [e for e in cp.read_events(f"replica/{rid}") if e.reason == "ShardRestarted"]
    assert restarted.type == "warning"
    assert restarted.message == (
        "shard 0 on a started again by its agent (1 restart(s)): exited: exit code -9"
    )
    # And a failure it was (issue 41: a kill -9 of a serving engine gave no ShardFailed).
    [failed] = [e for e in cp.read_events(f"replica/{rid}") if e.reason == "ShardFailed"]
    assert (failed.type, failed.message) == ("warning", "shard 0 on a: exited: exit code -9")


def test_a_control_plane_that_starts_takes_running_engines_over_as_adopted_not_ready() -> None:
    """Issue 41: a control-plane restart recorded ShardReady for every engine: it read as if
    each had been started again."""
    before = control_plane()  # a replica of small ready on a, started under it
    before.record_news()
    told = [e.reason for e in before.read_events() if e.reason in ("ShardAdopted", "ShardReady")]
    assert told == ["ShardReady"]
    report = before.state.nodes["a"].report
    restarted = ControlPlane(
        ControlPlaneConfig(admin_token=TOKEN, settle_for=-1), before.catalogs, ca=before.ca
    )
    restarted.state.take_report(report, before.catalogs.current, time.monotonic())
    restarted.record_news()
    adopted = [e for e in restarted.read_events() if e.reason in ("ShardAdopted", "ShardReady")]
    assert [(e.reason, e.message) for e in adopted][-1:] == [
        ("ShardAdopted", "shard 0 on a serving (pid 123)")
    ]
