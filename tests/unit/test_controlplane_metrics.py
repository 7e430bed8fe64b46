"""The control plane's Prometheus metrics (`controlplane/metrics.py`), scraped in-process from
its admin listener: the fleet as its state says, and what happened between scrapes."""

from __future__ import annotations

import asyncio
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from modelfleet.controlplane.agent_api import create_agent_app
from modelfleet.controlplane.service import create_apps
from modelfleet.messages.wire import AgentReport

from .test_admin_api import TOKEN, control_plane

METRICS_TOKEN = "metrics-token-0123456789"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape: (name, sorted labels) -> value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_control_plane_says_its_fleet_and_what_happened_as_prometheus_metrics() -> None:
    cp = control_plane()  # nodes a and b (a GPU of each unhealthy), small: 1 of 2 serving
    cp.config = cp.config.model_copy(
        update={"metrics_token": METRICS_TOKEN, "insecure_agent_api": True}
    )
    _, admin_app = create_apps(cp)
    cp.reconcile_once(time.monotonic())

    async def go() -> str:
        admin = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=admin_app), base_url="http://cp"
        )
        agents = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_agent_app(cp)), base_url="http://cp"
        )
        async with admin, agents:
            report = AgentReport(node="c", boot_id="b", seq=1, address="127.0.0.1", gpus=[],
                                 shards=[])  # fmt: skip
            assert (await agents.post("/v1/report", content=report.model_dump_json())).is_success
            refused = await admin.get("/metrics", headers={"authorization": "Bearer nope"})
            assert refused.status_code == 401 and "metrics token" in refused.json()["error"]
            # The metrics token opens /metrics and nothing else.
            only = {"authorization": f"Bearer {METRICS_TOKEN}"}
            assert (await admin.get("/v1/status", headers=only)).status_code == 401
            by_admin = await admin.get("/metrics", headers={"authorization": f"Bearer {TOKEN}"})
            assert by_admin.status_code == 200
            scraped = await admin.get("/metrics", headers=only)
            assert scraped.status_code == 200
            assert scraped.headers["content-type"].startswith("text/plain")
            return scraped.text

    got = samples(asyncio.run(go()))
    assert got[("modelfleet_controlplane_nodes", (("state", "ready"),))] == 3
    assert got[("modelfleet_controlplane_nodes", (("state", "lost"),))] == 0
    assert got[("modelfleet_controlplane_gpus", (("health", "unhealthy"),))] == 2
    assert got[("modelfleet_controlplane_gpus", (("health", "healthy"),))] == 2
    small = (("model", "small"),)
    assert got[("modelfleet_controlplane_replicas_desired", small)] == 2
    assert got[("modelfleet_controlplane_replicas", (*small, ("state", "serving")))] == 1
    serving_or_not = sum(
        v for (n, labels), v in got.items()
        if n == "modelfleet_controlplane_replicas" and ("model", "small") in labels
    )  # fmt: skip
    assert serving_or_not == len(cp.state.of_model("small"))
    pending = [
        (dict(labels), v) for (n, labels), v in got.items()
        if n == "modelfleet_controlplane_replicas_pending"
    ]  # fmt: skip
    assert pending == [({"model": "wide", "reason": "no node can host a shard"}, 1.0)]
    assert got[("modelfleet_controlplane_reports_total", ())] == 1
    assert got[("modelfleet_controlplane_reconcile_plans_total", ())] == cp.plans >= 1
    assert got[("modelfleet_controlplane_catalog_version", ())] == cp.catalogs.current.version
