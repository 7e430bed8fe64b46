"""The control plane in-process: reports in, assignments and admin answers out (ASGI transport)."""

from __future__ import annotations

import asyncio
import gc
import io
import json
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from rich.console import Console

from modelfleet.agent.gpus import SimulatedGpus
from modelfleet.controlplane import service, views
from modelfleet.controlplane.autoscaler import Scale
from modelfleet.controlplane.catalogs import CatalogKeeper
from modelfleet.controlplane.config import ControlPlaneConfig
from modelfleet.controlplane.loads import Load
from modelfleet.controlplane.nodes import set_mark
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.controlplane.service import create_apps
from modelfleet.controlplane.views import replica_views
from modelfleet.core.fleet import Mark
from modelfleet.ctl.render import print_explanation
from modelfleet.messages.admin import Explanation
from modelfleet.messages.wire import (
    AgentReport,
    NodeAssignment,
    ShardReport,
    ShardState,
)
from modelfleet.store.sqlite import SqliteStore

TOKEN = "admin-token-123"


def keeper(models: list[dict[str, object]]) -> CatalogKeeper:
    """A keeper on an in-memory store whose current catalog holds `models`."""
    k = CatalogKeeper(SqliteStore(":memory:"))
    k.lead(0.0)
    k.apply(yaml.safe_dump({"models": models}), "api", 0.0)
    return k


def report(node: str, gpus: SimulatedGpus, seq: int = 1) -> AgentReport:
    return AgentReport(
        node=node, boot_id="b", seq=seq, address="127.0.0.1", gpus=gpus.gpus(), shards=[]
    )


def test_explain_placement_names_every_node_and_reason() -> None:
    catalog = keeper(
        [
            {"name": "small", "engine": "sim"},
            {"name": "h100", "engine": "sim", "gpu_model": "H100"},
            {"name": "wide", "engine": "sim", "gpus_per_shard": 4},
        ]
    )
    config = ControlPlaneConfig(catalog="unused.yaml", admin_token=TOKEN, settle_for=-1)
    cp = ControlPlane(config, catalog)
    now = time.monotonic()
    current = catalog.current
    cp.state.take_report(report("a", SimulatedGpus("4x80GB", {3: "XID 79"})), current, now)
    cp.state.take_report(report("b", SimulatedGpus("2x80GB")), current, now)
    cp.reconcile_once(now)

    placed = {r.replica.model for r in cp.state.replicas.values()}
    assert placed == {"small"}
    pending = {p.model: p.explanation.summary for p in cp.state.pending}
    assert set(pending) == {"h100", "wide"}

    _, admin = create_apps(cp)

    async def go() -> None:
        transport = httpx.ASGITransport(app=admin)
        headers = {"authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(
            transport=transport, base_url="http://cp", headers=headers
        ) as c:
            wide = (await c.get("/v1/explain/wide")).json()
            assert wide["placeable"] is False and wide["pending"] == 1
            reasons = {n["node"]: " ".join(n["reasons"]) for n in wide["nodes"]}
            assert "gpu 3 unhealthy: XID 79" in reasons["a"] and "has 2" in reasons["a"]
            assert "needs 4 GPU(s), has 2" in reasons["b"]
            h100 = (await c.get("/v1/explain/h100")).json()
            assert all("not H100" in " ".join(n["reasons"]) for n in h100["nodes"])
            small = (await c.get("/v1/explain/small")).json()
            assert small["placeable"] is True and small["placement"][0]["node"] == "b"  # spread
            assert (await c.get("/v1/explain/nope")).status_code == 404
            assert (
                await c.get("/v1/explain/small", headers={"authorization": "Bearer x"})
            ).status_code == 401
            replicas = (await c.get("/v1/replicas")).json()
            assert {p["model"] for p in replicas["pending"]} == {"h100", "wide"}
            nodes = (await c.get("/v1/nodes")).json()["nodes"]
            gpu3 = next(g for n in nodes if n["name"] == "a" for g in n["gpus"] if g["index"] == 3)
            assert gpu3 == {**gpu3, "healthy": False, "reason": "XID 79", "in_use": False}

            out = io.StringIO()
            print_explanation(Explanation.model_validate(wide), Console(file=out, width=200))
            assert "XID 79" in out.getvalue() and "WHY NOT" in out.getvalue()

    asyncio.run(go())


def test_agent_api_checks_token_size_shape_and_staleness() -> None:
    catalog = keeper([{"name": "m", "engine": "sim"}])
    config = ControlPlaneConfig(
        catalog="unused.yaml",
        admin_token=TOKEN,
        agent_token="agent-token-0123456789",
        settle_for=-1,
        max_report_bytes=4096,
    )
    cp = ControlPlane(config, catalog)
    agent_app, _ = create_apps(cp)

    async def go() -> None:
        transport = httpx.ASGITransport(app=agent_app)
        headers = {"authorization": "Bearer agent-token-0123456789"}
        async with httpx.AsyncClient(
            transport=transport, base_url="http://cp", headers=headers
        ) as c:
            body = report("n", SimulatedGpus("1x80GB"), seq=5).model_dump_json()
            assert (
                await c.post("/v1/report", content=body, headers={"authorization": "x"})
            ).status_code == 401
            assert (await c.post("/v1/report", content=b'{"node": 1}')).status_code == 400
            assert (await c.post("/v1/report", content=b"x" * 5000)).status_code == 413
            ok = await c.post("/v1/report", content=body)
            assert ok.status_code == 200
            assert NodeAssignment.model_validate_json(ok.content).node == "n"
            stale = report("n", SimulatedGpus("1x80GB"), seq=4).model_dump_json()
            assert (await c.post("/v1/report", content=stale)).status_code == 409
            assert cp.state.nodes["n"].report.seq == 5  # the refused report changed nothing
            cp.reconcile_once(time.monotonic())
            again = report("n", SimulatedGpus("1x80GB"), seq=6).model_dump_json()
            assignment = NodeAssignment.model_validate_json(
                (await c.post("/v1/report", content=again)).content
            )
            assert [(s.model, s.gpus) for s in assignment.shards] == [("m", [0])]

    asyncio.run(go())


class FakeRouter:
    """A router's push API behind httpx.MockTransport: holds the snapshots it is sent."""

    def __init__(self) -> None:
        self.held: dict[str, Any] | None = None
        self.down = False

    def handle(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("router down", request=request)
        snap = json.loads(request.content)
        order = (snap["epoch"], snap["version"])
        if self.held is None or order >= (self.held["epoch"], self.held["version"]):
            self.held = snap
        held = {"epoch": self.held["epoch"], "version": self.held["version"]}
        applied = self.held is snap
        return httpx.Response(200 if applied else 409, json={"applied": applied, **held})

    def endpoints(self, model: str) -> list[str] | None:
        assert self.held is not None
        return next((m["endpoints"] for m in self.held["models"] if m["name"] == model), None)


def serving_report(cp: ControlPlane, node: str, seq: int, gpus: SimulatedGpus) -> AgentReport:
    """What an agent that runs every assigned shard, all ready, would report."""
    catalog = cp.catalogs.current
    shards = [
        ShardReport.of(a, ShardState.READY, port=9000 + i)
        for i, a in enumerate(cp.assignments.of(node, catalog).shards)
    ]
    return AgentReport(
        node=node, boot_id="b", seq=seq, address="127.0.0.1", gpus=gpus.gpus(), shards=shards
    )


def test_a_removed_model_leaves_the_routers_before_its_engine_is_stopped() -> None:
    fake = FakeRouter()
    config = ControlPlaneConfig(
        admin_token=TOKEN,
        settle_for=-1,
        retire_timeout=5,
        routers=[{"url": "http://router", "token": "t"}],
    )
    catalogs = keeper([{"name": "a", "engine": "sim"}, {"name": "b", "engine": "sim"}])
    http = httpx.AsyncClient(transport=httpx.MockTransport(fake.handle))
    cp = ControlPlane(config, catalogs, http=http)
    gpus = SimulatedGpus("2x80GB")

    async def go() -> None:
        now = time.monotonic()
        cp.state.take_report(report("n", gpus), catalogs.current, now)
        cp.reconcile_once(now)
        cp.state.take_report(serving_report(cp, "n", 2, gpus), catalogs.current, now)
        cp.publish()
        await cp.publisher.sync()
        assert fake.endpoints("a") and fake.endpoints("b")

        catalogs.apply("models:\n  - name: b\n    engine: sim\n", "api", time.time())
        fake.down = True  # the router does not hear of it yet
        cp.reconcile_once(now)
        cp.publish()
        await cp.publisher.sync()
        cp.release_retired(now)
        views = {v.model: v for v in replica_views(cp.state)}
        assert views["a"].state == "retiring" and "removed" in views["a"].reason
        routed = cp.routing.models(catalogs.current)
        assert [(m.name, m.endpoints) for m in routed] == [("b", fake.endpoints("b") or [])]
        # Unconfirmed by the router: the engine stays assigned and keeps serving.
        assigned = {s.model for s in cp.assignments.of("n", catalogs.current).shards}
        assert assigned == {"a", "b"}
        assert fake.endpoints("a")  # the router still routes to it

        fake.down = False
        await cp.publisher.sync()  # pushed again to the router that missed the change
        assert fake.endpoints("a") is None
        cp.release_retired(now)
        assigned = {s.model for s in cp.assignments.of("n", catalogs.current).shards}
        assert assigned == {"b"}
        # Its GPU stays in use until the agent reports the engine gone.
        assert len(cp.state.used_slots()) == 2
        left = serving_report(cp, "n", 3, gpus)
        cp.state.take_report(left, catalogs.current, now)
        assert len(cp.state.used_slots()) == 1
        await http.aclose()

    asyncio.run(go())


def test_a_router_that_never_confirms_delays_a_stop_only_until_the_timeout() -> None:
    fake = FakeRouter()
    fake.down = True
    config = ControlPlaneConfig(
        admin_token=TOKEN,
        settle_for=-1,
        retire_timeout=5,
        routers=[{"url": "http://router", "token": "t"}],
    )
    catalogs = keeper([{"name": "a", "engine": "sim"}])
    http = httpx.AsyncClient(transport=httpx.MockTransport(fake.handle))
    cp = ControlPlane(config, catalogs, http=http)
    gpus = SimulatedGpus("1x80GB")

    async def go() -> None:
        now = 100.0
        cp.state.take_report(report("n", gpus), catalogs.current, now)
        cp.reconcile_once(now)
        cp.state.take_report(serving_report(cp, "n", 2, gpus), catalogs.current, now)
        catalogs.apply("models: []\n", "api", time.time())
        cp.reconcile_once(now)
        cp.publish()
        await cp.publisher.sync()
        cp.release_retired(now + 4.9)
        assert len(cp.assignments.of("n", catalogs.current).shards) == 1
        cp.release_retired(now + 5)
        assert cp.assignments.of("n", catalogs.current).shards == []
        assert "routers unconfirmed" in next(iter(cp.state.retired.values()))[0]
        await http.aclose()

    asyncio.run(go())


class FakeClock:
    """Both of a control plane's clocks, moved by the test."""

    def __init__(self, wall: float, mono: float) -> None:
        self.wall, self.mono = wall, mono

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


def test_marks_are_set_through_the_admin_api_and_outlive_a_restart(tmp_path: Path) -> None:
    config = ControlPlaneConfig(admin_token=TOKEN, settle_for=-1, drain_grace=120)
    headers = {"authorization": f"Bearer {TOKEN}"}
    clock = FakeClock(wall=1_000_000.0, mono=50.0)

    def start() -> ControlPlane:
        catalogs = CatalogKeeper(SqliteStore(tmp_path / "store.sqlite"))
        catalogs.lead(clock.time())
        cp = ControlPlane(config, catalogs, clock=clock)
        for name in ("a", "b"):
            cp.state.take_report(report(name, SimulatedGpus("1x80GB")), catalogs.current, 0.0)
        return cp

    async def call(cp: ControlPlane, node: str, body: object) -> httpx.Response:
        _, admin = create_apps(cp)
        transport = httpx.ASGITransport(app=admin)
        async with httpx.AsyncClient(transport=transport, base_url="http://cp") as c:
            return await c.post(f"/v1/nodes/{node}/mark", json=body, headers=headers)

    async def go() -> None:
        cp = start()
        r = await call(cp, "a", {"mark": "cordoned"})
        assert r.status_code == 200 and r.json()["was"] == "none"
        r = await call(cp, "b", {"mark": "draining"})
        assert r.json()["drain_grace_s"] == 120
        assert (await call(cp, "nope", {"mark": "cordoned"})).status_code == 404
        bad = await call(cp, "a", {"mark": "locked"})
        assert bad.status_code == 400 and "cordoned" in bad.json()["error"]
        assert (await call(cp, "a", {"mark": "draining", "grace_s": -1})).status_code == 400
        cp.store.close()

        clock.advance(15)  # the control plane is down for 15 s, and its monotonic clock moves
        clock.mono += 1000  # on by more than the wall clock (a reboot would restart it)
        again = start()
        marks = {n.name: n for n in again.state.node_list()}
        assert marks["a"].mark is Mark.CORDONED and marks["a"].drain_deadline is None
        assert marks["b"].mark is Mark.DRAINING
        # The grace period carried across the restart, counted on the wall clock.
        assert marks["b"].drain_deadline == clock.monotonic() + 105
        nodes = {n.name: n for n in views.nodes(again.state, clock.monotonic()).nodes}
        assert nodes["a"].mark == "cordoned" and nodes["b"].drain_grace_left_s == 105
        r = await call(again, "a", {"mark": "none"})
        assert r.json()["was"] == "cordoned" and again.state.marks.keys() == {"b"}
        assert [m.node for m in again.store.marks()] == ["b"]
        again.store.close()

    asyncio.run(go())


def test_every_shard_is_told_its_rank_and_where_shard_0_meets_its_peers() -> None:
    catalogs = keeper([{"name": "tp", "engine": "sim", "shards": 2, "gpus_per_shard": 2}])
    config = ControlPlaneConfig(admin_token=TOKEN, settle_for=-1)
    cp = ControlPlane(config, catalogs)
    catalog = catalogs.current
    gpus = SimulatedGpus("2x80GB")
    for node in ("a", "b"):
        cp.state.take_report(
            AgentReport(
                node=node,
                boot_id="b",
                seq=1,
                address=f"10.0.0.{ord(node)}",
                gpus=gpus.gpus(),
                shards=[],
            ),
            catalog,
            1.0,
        )
    cp.reconcile_once(1.0)
    [a] = cp.assignments.of("a", catalog).shards
    [b] = cp.assignments.of("b", catalog).shards
    assert (a.rank, a.num_shards, b.rank, b.num_shards) == (0, 2, 1, 2)
    assert a.replica_id == b.replica_id and a.leader is None and b.leader is None

    # Shard 0's agent reports the port its peers are to meet it at; then everyone is told.
    rank0 = ShardReport.of(a, ShardState.STARTING, dist_port=29500)
    cp.state.take_report(
        AgentReport(
            node="a", boot_id="b", seq=2, address="10.0.0.97", gpus=gpus.gpus(), shards=[rank0]
        ),
        catalog,
        2.0,
    )
    assert cp.assignments.of("b", catalog).shards[0].leader == "10.0.0.97:29500"
    assert cp.assignments.of("a", catalog).shards[0].leader == "10.0.0.97:29500"


def test_a_replica_failing_on_a_node_moves_off_it() -> None:
    config = ControlPlaneConfig(admin_token=TOKEN, settle_for=-1, max_failures=3)
    catalogs = keeper([{"name": "a", "engine": "sim"}])
    cp = ControlPlane(config, catalogs)
    gpus = SimulatedGpus("1x80GB")
    catalog = catalogs.current
    for node in ("n1", "n2"):
        cp.state.take_report(report(node, gpus), catalog, 1.0)
    cp.reconcile_once(1.0)
    [first] = cp.state.replicas.values()
    node = first.replica.shards[0].node

    def failing(failures: int, seq: int) -> AgentReport:
        [a] = cp.assignments.of(node, catalog).shards
        shard = ShardReport.of(a, ShardState.FAILED, failures=failures, error="engine exited (1)")
        return AgentReport(
            node=node, boot_id="b", seq=seq, address="127.0.0.1", gpus=gpus.gpus(), shards=[shard]
        )

    cp.state.take_report(failing(2, 2), catalog, 2.0)
    cp.reconcile_once(2.0)
    assert list(cp.state.replicas) == [first.replica.id]  # two failures: restarted in place
    cp.state.take_report(failing(3, 3), catalog, 3.0)
    cp.reconcile_once(3.0)
    shown = {v.id: v for v in replica_views(cp.state)}
    assert shown[first.replica.id].state == "retiring"
    assert "failed 3 times in a row" in shown[first.replica.id].reason
    [moved] = [v for v in shown.values() if v.id != first.replica.id]
    assert moved.shards[0].node != node
    explained = views.explain(cp.state, catalog, "a", 3.0)
    assert explained is not None
    verdict = next(v for v in explained.verdicts if v.node == node)
    assert any("avoided" in r and "engine exited (1)" in r for r in verdict.reasons)


def test_only_a_push_the_router_took_confirms_and_a_restarted_router_is_pushed_again(
    tmp_path: Path,
) -> None:
    """A 409 is no confirmation: a retiring replica waits for a real one. A router that lost
    its table (it restarted) is found by the check and pushed the current one. Every start of
    the control plane is a new epoch, which a router takes over its older table."""
    fake = FakeRouter()
    config = ControlPlaneConfig(
        admin_token=TOKEN,
        settle_for=-1,
        retire_timeout=60,
        routers=[{"url": "http://r", "token": "t"}],
    )
    gpus = SimulatedGpus("2x80GB")

    def start() -> tuple[ControlPlane, httpx.AsyncClient]:
        catalogs = CatalogKeeper(SqliteStore(tmp_path / "store.sqlite"))
        catalogs.lead(0.0)
        catalogs.apply(yaml.safe_dump({"models": [{"name": "a", "engine": "sim"}]}), "api", 0.0)
        http = httpx.AsyncClient(transport=httpx.MockTransport(handle))
        return ControlPlane(config, catalogs, http=http), http

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/routing/held":
            held = fake.held or {"epoch": 0, "version": 0}
            body = {"applied": fake.held is not None, **{k: held[k] for k in ("epoch", "version")}}
            return httpx.Response(200, json=body)
        return fake.handle(request)

    async def go() -> None:
        cp, http = start()
        router = config.routers[0]
        now = 1.0
        cp.state.take_report(report("n", gpus), cp.catalogs.current, now)
        cp.reconcile_once(now)
        cp.state.take_report(serving_report(cp, "n", 2, gpus), cp.catalogs.current, now)
        cp.publish()
        await cp.publisher.sync()
        assert fake.endpoints("a") and cp.publisher.current(router)

        # The router restarts: it holds nothing. The check finds that and pushes again.
        fake.held = None
        await cp.publisher.check(router)
        assert fake.endpoints("a") and cp.publisher.current(router)

        # A router that holds a newer table (another control plane's) refuses with 409.
        fake.held = {"epoch": 99, "version": 1, "models": []}
        cp.catalogs.apply("models: []\n", "api", 0.0)
        cp.reconcile_once(now)
        cp.publish()
        await cp.publisher.sync()
        assert not cp.publisher.current(router)
        assert cp.publisher.routed_version() < cp.publisher.version
        cp.release_retired(now)
        assert len(cp.assignments.of("n", cp.catalogs.current).shards) == 1  # still running
        first_epoch = cp.publisher.epoch
        cp.store.close()
        await http.aclose()

        fake.held = {"epoch": first_epoch, "version": 50, "models": []}
        again, http = start()
        assert again.publisher.epoch == first_epoch + 1
        again.state.take_report(report("n", gpus), again.catalogs.current, now)
        again.publish()
        await again.publisher.sync()
        assert fake.held["epoch"] == first_epoch + 1 and again.publisher.current(router)
        again.store.close()
        await http.aclose()

    asyncio.run(go())


def test_a_node_silent_for_node_forget_after_is_forgotten_unless_it_holds_replicas() -> None:
    config = ControlPlaneConfig(
        admin_token=TOKEN, settle_for=-1, node_lost_after=100, node_forget_after=100
    )
    catalogs = keeper([{"name": "a", "engine": "sim"}])
    cp = ControlPlane(config, catalogs)
    gpus = SimulatedGpus("1x80GB")
    for node in ("busy", "idle"):
        cp.state.take_report(report(node, gpus), catalogs.current, 0.0)
    cp.reconcile_once(0.0)
    [holder] = {s.node for r in cp.state.replicas.values() for s in r.replica.shards}
    for node in ("busy", "idle"):  # cordoned: what they hold stays, nothing new comes
        asyncio.run(set_mark(cp, node, Mark.CORDONED, 0))
    cp.reconcile_once(100.0)
    assert set(cp.state.nodes) == {"busy", "idle"}  # not yet: silent for exactly 100 s
    cp.reconcile_once(100.5)
    cp.reconcile_once(101.0)  # a pass plans for silences a reconcile interval (1 s) late
    assert set(cp.state.nodes) == {holder}  # the idle one is forgotten, the holder kept
    # Their marks go with them, out of the store, after the pass.
    assert {m.node for m in cp.store.marks()} == {"busy", "idle"}
    asyncio.run(cp.term.node_news.clear_marks(cp.calls))
    assert {m.node for m in cp.store.marks()} == {holder}


def test_a_slow_preview_and_a_hung_router_hold_up_neither_reports_nor_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dry run that takes long (hundreds of planner passes at a large fleet) runs off the
    event loop, and pushes to a router that never answers run in tasks of their own: agents'
    reports are answered and reconcile passes go on meanwhile."""
    from modelfleet.controlplane import term as plane

    release = threading.Event()
    real = plane.preview

    def slow(*args: Any, **kwargs: Any) -> Any:
        assert release.wait(20), "the test did not release the preview"
        return real(*args, **kwargs)

    monkeypatch.setattr(plane, "preview", slow)
    never = asyncio.Event()

    async def hung(request: httpx.Request) -> httpx.Response:
        await never.wait()
        raise AssertionError("unreachable")

    config = ControlPlaneConfig(
        admin_token=TOKEN,
        insecure_agent_api=True,
        settle_for=-1,
        reconcile_interval=0.05,
        push_interval=0.05,
        routers=[{"url": "http://hung", "token": "t"}],
    )
    catalogs = keeper([{"name": "a", "engine": "sim"}])
    cp = ControlPlane(config, catalogs, http=httpx.AsyncClient(transport=httpx.MockTransport(hung)))
    agent_app, admin_app = create_apps(cp)

    async def go() -> None:
        loops = [asyncio.create_task(cp.reconcile_loop()), asyncio.create_task(cp.publisher.run())]
        admin = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=admin_app),
            base_url="http://cp",
            headers={"authorization": f"Bearer {TOKEN}"},
        )
        agents = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=agent_app), base_url="http://cp"
        )
        try:
            dry_run = asyncio.create_task(
                admin.put("/v1/catalog?dry_run=true", content="models: []\n")
            )
            for seq in (1, 2, 3):
                body = report("n", SimulatedGpus("1x80GB"), seq=seq).model_dump_json()
                answered = await asyncio.wait_for(agents.post("/v1/report", content=body), 10)
                assert answered.status_code == 200
            passes = cp.passes
            deadline = asyncio.get_running_loop().time() + 10
            while cp.passes < passes + 3:
                assert asyncio.get_running_loop().time() < deadline, "passes stopped"
                await asyncio.sleep(0.01)
            assert not dry_run.done()
            release.set()
            assert (await asyncio.wait_for(dry_run, 10)).status_code == 200
        finally:
            release.set()
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            await admin.aclose()
            await agents.aclose()

    asyncio.run(go())


def test_a_replica_put_to_sleep_leaves_the_routers_before_its_agent_is_told() -> None:
    fake = FakeRouter()
    config = ControlPlaneConfig(
        admin_token=TOKEN, settle_for=-1, routers=[{"url": "http://router", "token": "t"}]
    )
    scaled = {"min": 0, "max": 1, "target_in_flight": 2}
    catalogs = keeper([{"name": "a", "engine": "sim", "autoscale": scaled, "idle_action": "sleep"}])
    http = httpx.AsyncClient(transport=httpx.MockTransport(fake.handle))
    cp = ControlPlane(config, catalogs, http=http)
    gpus = SimulatedGpus("1x80GB")

    def told() -> list[tuple[bool, bool]]:
        shards = cp.assignments.of("n", catalogs.current).shards
        return [(s.sleep_mode, s.asleep) for s in shards]

    async def go() -> None:
        now = time.monotonic()
        cp.autoscaler.scales["a"] = Scale(1, "test", 0.0)
        cp.state.take_report(report("n", gpus), catalogs.current, now)
        cp.reconcile_once(now)
        cp.state.take_report(serving_report(cp, "n", 2, gpus), catalogs.current, now)
        cp.publish()
        await cp.publisher.sync()
        assert fake.endpoints("a") and told() == [(True, False)]

        cp.autoscaler.scales["a"] = Scale(0, "test", 0.0)
        cp.replan()
        fake.down = True  # the router does not hear of it yet
        cp.reconcile_once(now)
        cp.publish()
        await cp.publisher.sync()
        cp.release_retired(now)
        [view] = replica_views(cp.state)
        assert view.state == "sleeping"
        assert told() == [(True, False)]  # the router may still send to it: awake

        fake.down = False
        await cp.publisher.sync()
        assert fake.endpoints("a") == []
        cp.release_retired(now)
        assert told() == [(True, True)]  # now its engine sleeps

        cp.autoscaler.scales["a"] = Scale(1, "test", 0.0)
        cp.replan()
        cp.reconcile_once(now)
        assert told() == [(True, False)]  # woken, the same replica: nothing placed anew
        assert len(cp.state.replicas) == 1
        await http.aclose()

    asyncio.run(go())


def test_the_replica_ctl_catalog_apply_shows_stopping_is_the_one_the_pass_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Scaled down from three to two, the replica shown to stop (dry run, then the apply's own
    answer) is the one the next pass stops: the least loaded, as the routers say. A preview
    that planned without the loads showed the newest and the pass stopped another."""
    config = ControlPlaneConfig(admin_token=TOKEN, insecure_agent_api=True, settle_for=-1)
    catalogs = keeper([{"name": "a", "engine": "sim", "replicas": 3}])
    cp = ControlPlane(config, catalogs)
    _, admin_app = create_apps(cp)
    gpus = {n: SimulatedGpus("1x80GB") for n in ("n1", "n2", "n3")}

    async def go() -> None:
        now = time.monotonic()
        for node, g in gpus.items():
            cp.state.take_report(report(node, g), catalogs.current, now)
        cp.reconcile_once(now)
        for node, g in gpus.items():
            cp.state.take_report(serving_report(cp, node, 2, g), catalogs.current, now)
        ids = sorted(cp.state.replicas)
        assert len(ids) == 3 and all(cp.state.is_serving(rid) for rid in ids)
        # Loads that make "least loaded" and "newest" name different replicas.
        newest = min(ids, key=lambda rid: (-cp.state.replicas[rid].replica.created, rid))
        least = next(rid for rid in ids if rid != newest)
        carried = {rid: 0.0 if rid == least else 5.0 for rid in ids}
        monkeypatch.setattr(
            cp.loads, "loads", lambda _now: {"a": Load(total=10.0, replicas=carried)}
        )
        admin = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=admin_app),
            base_url="http://cp",
            headers={"authorization": f"Bearer {TOKEN}"},
        )
        scaled = yaml.safe_dump({"models": [{"name": "a", "engine": "sim", "replicas": 2}]})
        try:
            answers = [
                (await admin.put(f"/v1/catalog?dry_run={dry}", content=scaled)).json()
                for dry in ("true", "false")
            ]
        finally:
            await admin.aclose()
        for answer in answers:
            assert [(s["action"], s["id"]) for s in answer["steps"]] == [("stop", least)], answer
        cp.reconcile_once(time.monotonic())
        retiring = [v.id for v in replica_views(cp.state) if v.state == "retiring"]
        assert retiring == [least]

    asyncio.run(go())


def test_the_control_plane_freezes_what_lived_a_second_and_collects_fully_now_and_then() -> None:
    """A restart at 10,000 nodes spent 0.6-1.4 CPU-seconds of its 10 in the collector,
    scanning reports' objects that live as long as the term; what has lived a second is
    frozen out of its sight, and a full collection now and then finds the cycles among it
    that went out of use."""

    class Cycle:
        me: object

    clock = FakeClock(wall=0.0, mono=0.0)
    kept: list[object] = []
    seen: list[str] = []

    def collectable() -> set[int]:  # what the collector looks at (frozen objects it does not)
        return {id(o) for o in gc.get_objects()}

    async def tick(seconds: float) -> None:
        assert seconds == service.FREEZE_EVERY_S
        seen.append("tick")
        assert gc.isenabled(), "the collector is left off (`modelfleet control-plane` starts so)"
        if len(seen) == 1:
            cycle = Cycle()
            cycle.me = cycle
            kept.extend([[], cycle])
            assert id(kept[0]) in collectable()
        elif len(seen) == 2:
            assert id(kept[0]) not in collectable(), "not frozen after a second"
            kept.append(weakref.ref(kept.pop()))  # the cycle goes out of use, frozen
            clock.advance(service.FULL_COLLECTION_S + 1)
        else:
            dead = kept[-1]
            assert isinstance(dead, weakref.ref) and dead() is None, "the cycle was kept"
            raise asyncio.CancelledError

    threshold = gc.get_threshold()
    try:
        gc.disable()
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(service.keep_heap(tick, clock.monotonic))
        assert gc.get_threshold() == service.GC_THRESHOLDS
    finally:
        gc.enable()
        gc.unfreeze()
        gc.set_threshold(*threshold)
    assert len(seen) == 3
