"""Why a replica gets no requests: a router that took it out of rotation says so in its load
report, and the control plane makes it an event (once per ejection), shows the replica as
out of rotation, not ready, in `ctl replicas` and `ctl replicas show` (why, for how long),
and makes its return an event."""

from __future__ import annotations

import asyncio
import io
import time

import httpx
import yaml
from rich.console import Console

from modelfleet.agent.gpus import SimulatedGpus
from modelfleet.controlplane.catalogs import CatalogKeeper
from modelfleet.controlplane.config import ControlPlaneConfig
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.controlplane.service import create_apps
from modelfleet.ctl.render import print_replica, print_replicas
from modelfleet.messages.admin import ReplicaInfo, ReplicasAnswer
from modelfleet.messages.wire import AgentReport, Ejection, LoadReport, ShardReport, ShardState
from modelfleet.store.sqlite import SqliteStore

TOKEN = "admin-token-123"
WHY = "3 failures in a row, the last: HTTP 503"


def test_a_router_s_ejection_is_an_event_once_and_shows_on_the_replica() -> None:
    polls: list[float] = []
    report = LoadReport()

    def router(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/load":
            polls.append(time.monotonic())
            return httpx.Response(200, content=report.model_dump_json())
        return httpx.Response(200, json={"applied": True, "epoch": 1, "version": 1})

    config = ControlPlaneConfig(
        admin_token=TOKEN, settle_for=-1, routers=[{"url": "http://router", "token": "t"}]
    )
    http = httpx.AsyncClient(transport=httpx.MockTransport(router))
    catalogs = CatalogKeeper(SqliteStore(":memory:"))
    catalogs.lead(0.0)
    catalogs.apply(yaml.safe_dump({"models": [{"name": "m", "engine": "sim"}]}), "api", 0.0)
    cp = ControlPlane(config, catalogs, http=http)

    async def polled(times: int) -> None:
        """Wait for `times` more answers of the router's load poll."""
        until, deadline = len(polls) + times, time.monotonic() + 10
        while len(polls) < until:
            assert time.monotonic() < deadline, f"waited 10 s for {times} load polls"
            await asyncio.sleep(0.01)

    def ejected_events(reason: str = "ReplicaEjected") -> list[str]:
        return [e.message for e in cp.read_events(limit=50) if e.reason == reason]

    async def go() -> None:
        nonlocal report
        now = time.monotonic()
        gpus = SimulatedGpus("1x80GB").gpus()
        node = AgentReport(node="n", boot_id="b", seq=1, address="127.0.0.1", gpus=gpus, shards=[])
        cp.state.take_report(node, catalogs.current, now)
        cp.reconcile_once(now)
        [rid] = cp.state.replicas
        [shard] = cp.assignments.of("n", catalogs.current).shards
        ready = ShardReport.of(shard, ShardState.READY, port=9000)
        cp.state.take_report(
            node.model_copy(update={"seq": 2, "shards": [ready]}), catalogs.current, now
        )
        polling = asyncio.create_task(cp.loads.run())
        await polled(2)
        assert ejected_events() == []

        report = LoadReport(ejected={rid: Ejection(why=WHY, left_s=5.0, times=1)})
        await polled(3)  # the same ejection, told three times: one event
        said = f"router http://router sends it no requests: {WHY}; a health probe in 5s"
        assert ejected_events() == [f"{said} decides whether it is back"]

        _, admin = create_apps(cp)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=admin),
            base_url="http://cp",
            headers={"authorization": f"Bearer {TOKEN}"},
        ) as client:
            one = ReplicaInfo.model_validate((await client.get(f"/v1/replicas/{rid}")).json())
            # What its clients get: out of rotation, though every shard is ready (issue 41:
            # it showed "ready" while every request to it got 503).
            assert one.state == "out-of-rotation" and one.shards[0].state == "ready"
            [why] = one.ejected
            assert why.startswith("router http://router sends it no requests for ")
            assert why.endswith(f"s: {WHY}; a health probe in 5s decides whether it is back")
            listed = ReplicasAnswer.model_validate((await client.get("/v1/replicas")).json())
            assert [(r.state, r.ejected) for r in listed.replicas] == [(one.state, one.ejected)]
            shown = io.StringIO()
            print_replica(one, Console(file=shown, width=300))
            print_replicas(listed, Console(file=shown, width=300))
            assert f"out of rotation: {why}" in shown.getvalue()
            assert "state out-of-rotation" in shown.getvalue()
            assert "out of rotation at 1 router(s)" in shown.getvalue()
            assert ejected_events("ReplicaReturned") == []

            report = LoadReport()  # back in rotation
            await polled(2)
            one = ReplicaInfo.model_validate((await client.get(f"/v1/replicas/{rid}")).json())
            assert (one.state, one.ejected) == ("ready", [])
            [back] = ejected_events("ReplicaReturned")
            assert back.startswith("router http://router sends it requests again, after ")
            # Out again later: a new ejection, a new event.
            report = LoadReport(ejected={rid: Ejection(why=WHY, left_s=10.0, times=2)})
            await polled(2)
            assert len(ejected_events()) == 2
            assert ejected_events()[-1].endswith("(out 2 times in a row)")
        polling.cancel()
        await http.aclose()

    asyncio.run(go())


def test_a_router_with_workers_tells_a_replica_out_at_several_once_with_the_longest_time() -> None:
    from modelfleet.router.workers import _summed_loads

    short, long = Ejection(why="a", left_s=2.0, times=1), Ejection(why="b", left_s=9.0, times=2)
    one = LoadReport(ejected={"r1": short})
    two = LoadReport(ejected={"r1": long, "r2": short})
    assert _summed_loads([one, two]).ejected == {"r1": long, "r2": short}
    assert _summed_loads([two, one]).ejected == {"r1": long, "r2": short}
