"""The control plane's autoscaling: the routers' loads combined, counts decided, stored (a
new leader keeps them), evented, planned and shown; nothing decided without a signal."""

from __future__ import annotations

import asyncio
import time

import httpx
import yaml

from modelfleet.agent.gpus import SimulatedGpus
from modelfleet.controlplane.autoscaler import Autoscaler
from modelfleet.controlplane.catalogs import CatalogKeeper
from modelfleet.controlplane.config import ControlPlaneConfig
from modelfleet.controlplane.events import EventLog
from modelfleet.controlplane.loads import Load, combine
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.controlplane.service import create_apps
from modelfleet.messages.wire import AgentReport, LoadReport, ModelLoad
from modelfleet.store.calls import StoreCalls
from modelfleet.store.sqlite import SqliteStore

from .awaited import Awaited

TOKEN = "admin-token-123"
SCALED = {
    "name": "m",
    "engine": "sim",
    "max_parallel": 2,
    "autoscale": {"min": 0, "max": 3, "target_in_flight": 2, "scale_up_after": 1,
                  "scale_down_after": 5, "scale_to_zero_after": 10},
}  # fmt: skip


def test_loads_sum_what_routers_send_and_hold_and_take_the_engines_count_once() -> None:
    a = LoadReport(
        models={
            "m": ModelLoad(
                in_flight=3, held=2, engines=5, replicas={"r1": (3, 5)}, cache={"r1": 0.25}
            )
        }
    )
    b = LoadReport(
        models={
            "m": ModelLoad(
                in_flight=4,
                held=1,
                engines=6,
                replicas={"r1": (1, 6), "r2": (3, 0)},
                cache={"r1": 0.5, "r2": 0.1},
            )
        }
    )
    loads = combine([a, b])
    assert loads["m"].total == 3 + 7  # held by both, plus the 7 they sent (more than 6)
    assert loads["m"].held == 3
    assert dict(loads["m"].replicas) == {"r1": 6.0, "r2": 3.0}
    # What the engines say of themselves, per replica: the latest reading of any router.
    assert dict(loads["m"].engines) == {"r1": 6, "r2": 0}
    assert dict(loads["m"].cache) == {"r1": 0.5, "r2": 0.1}
    # Requests that reached the engines some other way, or wait there, count too.
    busy = LoadReport(models={"m": ModelLoad(in_flight=1, engines=9)})
    assert combine([busy])["m"].total == 9
    # An adapter's: asked of both routers, and its oldest held request of either.
    x1 = LoadReport(models={"x": ModelLoad(held=1, rate=0.5, waited=3.0)})
    x2 = LoadReport(models={"x": ModelLoad(held=1, rate=0.25, waited=7.5)})
    assert (combine([x1, x2])["x"].rate, combine([x1, x2])["x"].waited) == (0.75, 7.5)


def keeper(store: SqliteStore) -> CatalogKeeper:
    k = CatalogKeeper(store)
    k.lead(0.0)
    k.apply(yaml.safe_dump({"models": [SCALED]}), "api", 0.0)
    return k


def next_leader(store: SqliteStore) -> Autoscaler:
    """An autoscaler as the next leader's term begins: with the counts the store keeps."""
    scaler = Autoscaler(StoreCalls(store, 5.0), EventLog(store, time.time), time.time)
    scaler.load(scaler.stored())
    return scaler


def test_counts_are_decided_stored_for_the_next_leader_and_evented(tmp_path: object) -> None:
    store = SqliteStore(":memory:")
    catalogs = keeper(store)
    events = EventLog(store, time.time, source="test")
    scaler = Awaited(Autoscaler(StoreCalls(store, 5.0), events, time.time))
    catalog = catalogs.current
    assert scaler.wanted(catalog) == {"m": 0}

    assert scaler.step(catalog, None, 0.0) == []  # no router heard from: no signal
    assert scaler.step(catalog, {}, 0.0) == []  # no load: stays at zero
    assert scaler.step(catalog, {"m": Load(total=5, held=5)}, 1.0) == ["m"]
    assert scaler.wanted(catalog) == {"m": 3}  # from zero at once, enough for the load
    assert "up from zero" in scaler.scales["m"].reason

    # The next leader reads the same count from the store.
    assert next_leader(store).wanted(catalog) == {"m": 3}
    events.flush()
    scaled = [e for e in store.events(limit=50) if e.reason == "ReplicasScaled"]
    assert [e.message.split(":")[0] for e in scaled] == ["0 -> 3"]
    assert "load 5 on 0 replica(s)" in scaled[0].message

    # Low for scale_down_after: one down, unless a replica of it is being replaced.
    for t in range(2, 9):
        scaler.step(catalog, {"m": Load(total=1)}, float(t), replacing={"m"})
    assert scaler.wanted(catalog) == {"m": 3}
    for t in range(9, 12):
        scaler.step(catalog, {"m": Load(total=1)}, float(t))
    assert scaler.wanted(catalog) == {"m": 2}

    # A model gone from the catalog leaves the stored counts.
    catalogs.apply(yaml.safe_dump({"models": [{"name": "m", "engine": "sim"}]}), "api", 0.0)
    assert scaler.step(catalogs.current, None, 20.0) == []
    assert next_leader(store).scales == {}


def test_requests_held_for_a_model_s_adapters_are_its_load() -> None:
    store = SqliteStore(":memory:")
    catalogs = CatalogKeeper(store)
    catalogs.lead(0.0)
    with_adapters = {**SCALED, "adapters": [{"name": "x", "source": "/x"}]}
    catalogs.apply(yaml.safe_dump({"models": [with_adapters]}), "api", 0.0)
    scaler = Awaited(Autoscaler(StoreCalls(store, 5.0), EventLog(store, time.time), time.time))
    # At zero replicas, a request for its adapter is held as the adapter's (the router
    # routes an adapter as a model of its own): it wakes the model from zero.
    assert scaler.step(catalogs.current, {"x": Load(total=1, held=1)}, 1.0) == ["m"]
    assert scaler.wanted(catalogs.current) == {"m": 1}
    assert "up from zero" in scaler.scales["m"].reason


class Routers:
    """A router's push API that answers the load the test sets."""

    def __init__(self) -> None:
        self.report = LoadReport()

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/load":
            return httpx.Response(200, content=self.report.model_dump_json())
        return httpx.Response(200, json={"applied": True, "epoch": 1, "version": 1})


def test_a_load_read_from_the_routers_places_replicas_and_shows_in_status() -> None:
    routers = Routers()
    config = ControlPlaneConfig(
        admin_token=TOKEN, settle_for=-1, routers=[{"url": "http://router", "token": "t"}]
    )
    http = httpx.AsyncClient(transport=httpx.MockTransport(routers.handle))
    catalogs = keeper(SqliteStore(":memory:"))
    cp = ControlPlane(config, catalogs, http=http)
    gpus = SimulatedGpus("4x80GB")

    async def go() -> None:
        now = time.monotonic()
        node = AgentReport(
            node="n", boot_id="b", seq=1, address="127.0.0.1", gpus=gpus.gpus(), shards=[]
        )
        cp.state.take_report(node, catalogs.current, now)
        cp.reconcile_once(now)
        assert not cp.state.replicas  # min 0, no load: nothing runs

        routers.report = LoadReport(models={"m": ModelLoad(held=3)})
        polling = asyncio.create_task(cp.loads.run())
        deadline = time.monotonic() + 10
        while not cp.loads.reports:
            assert time.monotonic() < deadline, "waited 10 s for the router's load"
            await asyncio.sleep(0.01)
        polling.cancel()
        await cp.autoscale_once(cp.clock.monotonic())
        cp.reconcile_once(cp.clock.monotonic())
        assert sorted(r.replica.model for r in cp.state.replicas.values()) == ["m", "m"]

        _, admin = create_apps(cp)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=admin),
            base_url="http://cp",
            headers={"authorization": f"Bearer {TOKEN}"},
        ) as client:
            status = (await client.get("/v1/status")).json()
            [shown] = status["scaling"]
            assert (shown["model"], shown["replicas"], shown["min"], shown["max"]) == ("m", 2, 0, 3)
            assert shown["load"] == 3 and "up from zero" in shown["reason"]
            listed = (await client.get("/v1/replicas")).json()
            assert listed["scaling"][0]["replicas"] == 2
        await http.aclose()

    asyncio.run(go())
