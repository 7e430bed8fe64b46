"""The routing table is rebuilt per model, only for the models a change touched, and the body
the publisher pushes, put together from each model's JSON, is the snapshot itself."""

from __future__ import annotations

from typing import Any

import httpx
import yaml

from modelfleet.agent.gpus import SimulatedGpus
from modelfleet.controlplane.catalogs import CatalogKeeper
from modelfleet.controlplane.config import ControlPlaneConfig, RouterTarget
from modelfleet.controlplane.plane import ControlPlane
from modelfleet.controlplane.publisher import Publisher
from modelfleet.core.residency import Want
from modelfleet.messages.wire import (
    AdapterReport,
    AdapterState,
    AgentReport,
    RoutedKey,
    RoutedModel,
    RoutingSnapshot,
    ShardReport,
    ShardState,
)
from modelfleet.store.sqlite import SqliteStore

GPUS = SimulatedGpus("2x80GB")


def fleet() -> ControlPlane:
    keeper = CatalogKeeper(SqliteStore(":memory:"))
    keeper.lead(0.0)
    # a on n1, b on n2
    models = [{"name": m, "engine": "sim", "replicas": 2, "node_labels": {"zone": m}} for m in "ab"]
    keeper.apply(yaml.safe_dump({"models": models}), "api", 0.0)
    cp = ControlPlane(ControlPlaneConfig(admin_token="admin-token-123", settle_for=-1), keeper)
    for node in ("n1", "n2"):
        cp.state.take_report(report(cp, node, 1, ready=False), keeper.current, 0.0)
    cp.reconcile_once(0.0)
    return cp


def report(cp: ControlPlane, node: str, seq: int, ready: bool, **seen: Any) -> AgentReport:
    state = ShardState.READY if ready else ShardState.STARTING
    assigned = cp.assignments.of(node, cp.catalogs.current).shards
    shards = [ShardReport.of(a, state, port=9000 + i, **seen) for i, a in enumerate(assigned)]
    zone = {"n1": "a", "n2": "b"}[node]
    return AgentReport(node=node, boot_id="b", seq=seq, address=f"10.0.0.{node[-1]}",
                       labels={"zone": zone}, gpus=GPUS.gpus(), shards=shards)  # fmt: skip


def test_a_change_rebuilds_only_the_models_it_touched() -> None:
    cp = fleet()
    catalog = cp.catalogs.current
    before = {m.name: m for m in cp.routing.models(catalog)}
    assert all(m.endpoints == [] for m in before.values())
    assert {cp.state.replicas[r].replica.model for r in cp.state.on_node("n1")} == {"a"}
    cp.state.take_report(report(cp, "n1", 2, ready=True), catalog, 1.0)
    after = {m.name: m for m in cp.routing.models(catalog)}
    assert len(after["a"].endpoints) == 2
    assert after["b"] is before["b"]  # untouched: the same entry, not built again
    assert cp.routing.models(catalog)[0] is cp.routing.models(catalog)[0]  # nothing new


def test_the_pushed_body_is_the_snapshot() -> None:
    publisher = Publisher([RouterTarget(url="http://r", token="t")], httpx.AsyncClient(), 3, 1.0)
    models = [
        RoutedModel(
            name="a", endpoints=["http://10.0.0.1:9000"], replicas={"http://10.0.0.1:9000": "a-1"}
        ),
        RoutedModel(name="b", endpoints=[], routing="prefix", max_tokens_cap=64),
    ]
    keys = [RoutedKey(name="k", sha256="0" * 64, models=["a"], rpm=60)]
    assert publisher.publish(7, models, keys)
    expected = RoutingSnapshot(epoch=3, version=1, catalog_version=7, models=models, keys=keys)
    assert RoutingSnapshot.model_validate_json(publisher.body) == expected
    assert not publisher.publish(7, list(models), list(keys))  # the same table: no new version
    assert publisher.publish(7, models[:1], [])
    expected = RoutingSnapshot(epoch=3, version=2, catalog_version=7, models=models[:1])
    assert RoutingSnapshot.model_validate_json(publisher.body) == expected


def test_adapters_are_assigned_by_the_control_plane_and_routed_where_they_are_loaded() -> None:
    keeper = CatalogKeeper(SqliteStore(":memory:"))
    keeper.lead(0.0)
    adapters = [{"name": n, "source": f"/lora/{n}"} for n in ("x", "y", "z")]
    model = {"name": "a", "engine": "sim", "replicas": 2, "max_loras": 1, "adapters": adapters}
    keeper.apply(yaml.safe_dump({"models": [model]}), "api", 0.0)
    cp = ControlPlane(ControlPlaneConfig(admin_token="admin-token-123", settle_for=-1), keeper)
    for node in ("n1", "n2"):
        cp.state.take_report(report(cp, node, 1, ready=False), keeper.current, 0.0)
    cp.reconcile_once(0.0)
    assert cp.place_adapters()
    catalog = cp.catalogs.current
    told = {
        a.replica_id: a.adapters
        for node in ("n1", "n2")
        for a in cp.assignments.of(node, catalog).shards
    }
    assert sorted(told.values(), key=str) == [{"x": "/lora/x"}, {"y": "/lora/y"}]
    assert not cp.place_adapters()  # decided once: kept

    def loaded(node: str, state: AdapterState, error: str = "") -> AgentReport:
        [shard] = cp.assignments.of(node, catalog).shards
        return report(
            cp, node, 2, ready=True,
            adapters=[AdapterReport(name=n, state=state, error=error) for n in shard.adapters],
        )  # fmt: skip

    cp.state.take_report(loaded("n1", AdapterState.LOADED), catalog, 1.0)
    cp.state.take_report(loaded("n2", AdapterState.FAILED, "No adapter found"), catalog, 1.0)
    [entry] = cp.routing.models(catalog)
    held_on_n1 = next(iter(next(a for a in told.values() if a)))  # n1 sorts first
    n1 = next(e for e in entry.endpoints if "10.0.0.1" in e)
    failed = ({"x", "y"} - {held_on_n1}).pop()
    assert entry.adapters == {held_on_n1: [n1], failed: [], "z": []}
    assert entry.adapter_errors == {failed: "No adapter found"}


def test_an_adapter_swap_leaves_the_routers_before_the_agent_unloads_it() -> None:
    keeper = CatalogKeeper(SqliteStore(":memory:"))
    keeper.lead(0.0)
    adapters = [{"name": n, "source": f"/lora/{n}"} for n in ("x", "y")]
    model = {"name": "a", "engine": "sim", "max_loras": 1, "adapters": adapters}
    keeper.apply(yaml.safe_dump({"models": [model]}), "api", 0.0)
    cp = ControlPlane(ControlPlaneConfig(admin_token="admin-token-123", settle_for=-1), keeper)
    catalog = keeper.current
    s = cp.state
    s.take_report(report(cp, "n1", 1, ready=False), catalog, 0.0)
    cp.reconcile_once(0.0)
    s.take_report(report(cp, "n1", 2, ready=False), catalog, 0.0)
    cp.reconcile_once(0.0)
    assert s.adapters.place(catalog, {}, 0.0, 5.0) == 1

    def told() -> dict[str, str]:
        return {
            k: v for a in cp.assignments.of("n1", catalog).shards for k, v in a.adapters.items()
        }

    def holders() -> dict[str, list[str]]:
        return cp.routing.models(catalog)[0].adapters

    assert told() == {"x": "/lora/x"}
    loaded = [AdapterReport(name="x", state=AdapterState.LOADED)]
    s.take_report(report(cp, "n1", 3, ready=True, adapters=loaded), catalog, 1.0)
    assert len(holders()["x"]) == 1

    # Requests wait for y: it is to take x's slot. x leaves the table at once; the agent is
    # told only once the routers hold a table without it.
    assert s.adapters.place(catalog, {"a": {"y": Want(held=3)}}, 2.0, 5.0) == 1
    assert holders() == {"x": [], "y": []}
    assert told() == {"x": "/lora/x"}
    s.mark_unrouted(7)
    assert s.adapters.swap(6, 3.0) == 0  # the routers hold version 6: not yet
    assert told() == {"x": "/lora/x"}
    assert s.adapters.swap(7, 3.0) == 1
    assert told() == {"y": "/lora/y"}
    # A router that never confirms holds a swap up for the grace only.
    assert s.adapters.place(catalog, {"a": {"x": Want(held=9)}}, 10.0, 5.0) == 1
    assert s.adapters.swap(-1, 14.9) == 0 and s.adapters.swap(-1, 15.0) == 1
    assert told() == {"x": "/lora/x"}


def test_a_model_none_of_whose_replicas_is_coming_is_routed_with_why() -> None:
    """The router said "try again shortly" to a model that could never serve: the table says
    why none is coming (a crash loop with its last error; replicas placeable nowhere), and
    nothing while one is starting afresh."""
    cp = fleet()
    catalog = cp.catalogs.current
    assert all(m.cannot_serve == "" for m in cp.routing.models(catalog))  # starting: coming
    looping = report(cp, "n1", 2, ready=False, failures=2, last_failure="exited: boom (1)")
    cp.state.take_report(looping, catalog, 1.0)
    [a, b] = cp.routing.models(catalog)
    assert "2 replica(s) failing" in a.cannot_serve and "exited: boom (1)" in a.cannot_serve
    assert b.cannot_serve == ""
    assert cp.routing.models(catalog)[0] is a  # the same entry while nothing changed
    # A third replica of b that fits nowhere, while b's two are starting: still coming.
    more = [{"name": m, "engine": "sim", "replicas": 3, "node_labels": {"zone": m}} for m in "ab"]
    cp.catalogs.apply(yaml.safe_dump({"models": more}), "api", 2.0)
    catalog = cp.catalogs.current
    cp.reconcile_once(2.0)
    [a, b] = cp.routing.models(catalog)
    assert b.cannot_serve == "" and "cannot be placed" in a.cannot_serve
    assert cp.state.pending_for("a") is not None
    # While GPUs are being let go (a replica retiring), the one pending may fit: coming.
    cp.state.retire([next(iter(cp.state.of_model("b")))], "scaled down", 3.0)
    assert [m.cannot_serve for m in cp.routing.models(catalog)] == ["", ""]
