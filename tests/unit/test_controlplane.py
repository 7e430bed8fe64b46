"""The control plane in-process: reports in, assignments and admin answers out (ASGI transport)."""

from __future__ import annotations

import asyncio
import io
import time

import httpx
from rich.console import Console

from modelfleet.agent.gpus import SimulatedGpus
from modelfleet.catalog import Catalog
from modelfleet.controlplane.config import ControlPlaneConfig
from modelfleet.controlplane.service import ControlPlane, create_apps
from modelfleet.ctl import print_explanation
from modelfleet.wire import AgentReport, NodeAssignment

TOKEN = "admin-token-123"


def report(node: str, gpus: SimulatedGpus, seq: int = 1) -> AgentReport:
    return AgentReport(
        node=node, boot_id="b", seq=seq, address="127.0.0.1", gpus=gpus.gpus(), shards=[]
    )


def test_explain_placement_names_every_node_and_reason() -> None:
    catalog = Catalog.new(
        [
            {"name": "small", "engine": "sim"},
            {"name": "h100", "engine": "sim", "gpu_model": "H100"},
            {"name": "wide", "engine": "sim", "gpus_per_shard": 4},
        ]
    )
    config = ControlPlaneConfig(catalog="unused.yaml", admin_token=TOKEN, settle_for=-1)
    cp = ControlPlane(config, catalog)
    now = time.monotonic()
    cp.state.take_report(report("a", SimulatedGpus("4x80GB", {3: "XID 79"})), now)
    cp.state.take_report(report("b", SimulatedGpus("2x80GB")), now)
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
            print_explanation(wide, Console(file=out, width=200))
            assert "XID 79" in out.getvalue() and "WHY NOT" in out.getvalue()

    asyncio.run(go())


def test_agent_api_checks_token_size_shape_and_staleness() -> None:
    catalog = Catalog.new([{"name": "m", "engine": "sim"}])
    config = ControlPlaneConfig(
        catalog="unused.yaml",
        admin_token=TOKEN,
        agent_token="agent-tok",
        settle_for=-1,
        max_report_bytes=4096,
    )
    cp = ControlPlane(config, catalog)
    agent_app, _ = create_apps(cp)

    async def go() -> None:
        transport = httpx.ASGITransport(app=agent_app)
        headers = {"authorization": "Bearer agent-tok"}
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
