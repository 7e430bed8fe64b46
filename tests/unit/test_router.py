"""The router's push API in-process: whole snapshots, swapped atomically, older ones ignored."""

from __future__ import annotations

import asyncio

import httpx

from modelfleet.router.service import Router, RouterConfig, create_apps
from modelfleet.wire import RoutedModel, RoutingSnapshot


def snap(version: int, **models: list[str]) -> str:
    routed = [RoutedModel(name=n, endpoints=e) for n, e in models.items()]
    return RoutingSnapshot(
        version=version, catalog_version=version, models=routed
    ).model_dump_json()


def test_the_router_takes_newer_snapshots_whole_and_ignores_older_ones() -> None:
    config = RouterConfig(
        push_token="push-token",
        api_keys=[{"name": "k", "key": "client-key"}],
        models=[RoutedModel(name="seeded", endpoints=["http://127.0.0.1:9"])],
    )
    router = Router(config)
    client_app, push_app = create_apps(router)

    async def go() -> None:
        push = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=push_app),
            base_url="http://push",
            headers={"authorization": "Bearer push-token"},
        )
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=client_app),
            base_url="http://router",
            headers={"authorization": "Bearer client-key"},
        )
        models = await client.get("/v1/models")
        assert [m["id"] for m in models.json()["data"]] == ["seeded"]  # served before any push

        assert (await push.put("/v1/routing", content=snap(5, a=["http://e1"]))).status_code == 200
        taken = router.table  # what a request in flight holds
        r = await push.put("/v1/routing", content=snap(7, b=["http://e2"], c=[]))
        assert r.json() == {"applied": True, "version": 7}
        older = await push.put("/v1/routing", content=snap(6, a=["http://e1"]))
        assert older.status_code == 409 and older.json() == {"applied": False, "version": 7}
        assert sorted(router.table.models) == ["b", "c"]
        assert dict(taken.models) == {"a": ("http://e1",)}  # a swap never edits a held table

        bad = await push.put("/v1/routing", content=b'{"version": -1}')
        assert bad.status_code == 400 and router.table.version == 7
        wrong = await push.put(
            "/v1/routing", content=snap(9), headers={"authorization": "Bearer x"}
        )
        assert wrong.status_code == 401 and router.table.version == 7

        gone = await client.post(
            "/v1/chat/completions", json={"model": "a", "messages": [{"role": "user"}]}
        )
        assert gone.status_code == 404
        empty = await client.post(
            "/v1/chat/completions", json={"model": "c", "messages": [{"role": "user"}]}
        )
        assert empty.status_code == 503
        await push.aclose()
        await client.aclose()

    asyncio.run(go())
